"""One embedded data folder per Redis: each folder's id, and the Redis key naming the live one.

Why. On the embedded backend every worker of a Redis must serve the one ``SIFT_DATA_DIR``,
on one host. Two workers given folders of their own each took a share of the ingests and
reads, so each index was split between the folders, every job ``succeeded``, and nothing said
so.

How. A folder has an id, made at random the first time a worker serves it and kept in it
(:data:`FOLDER_ID_FILE`): a folder moved keeps it, another host's folder has its own, and
the workers of one folder agree on it whatever path or host each sees it by (containers on
one volume). :data:`~worker.constants.DATA_FOLDER_KEY` holds the id of the folder the live
workers serve, with a ``host:path`` of it for messages; its holders
(:data:`~worker.constants.DATA_FOLDER_HOLDERS_KEY`) are every worker process, renewed by its
heartbeat (:mod:`worker.queue.liveness`), and a ``sift worker`` starting, for one
``SIFT_WORKER_DEAD_AFTER_SECONDS`` (until its processes beat). A claim of another folder's
id while a holder lives is refused (``sift worker`` exits 2); once the last holder stops
cleanly or lapses (its worker dead), the key goes and any folder may be claimed. A Redis
restarted keeps the key (its AOF); one flushed loses it, and the live workers' next beats
claim it again.

    other = claim(client, DataFolder.of(data_dir), holder, hold_seconds=10)
    # None: held (the key names this folder); else the other folder's "host:path"
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from worker.constants import DATA_FOLDER_HOLDERS_KEY, DATA_FOLDER_KEY

FOLDER_ID_FILE = "sift-folder-id"  # in the data folder, beside sift.db: the folder's id

# KEYS: the folder key, its holders. ARGV: the folder id, the key's value ("id host:path"), the
# holder, how long its hold lasts (ms). Answers the key's value if another folder's id is held
# by a live holder; else holds it (false). Flagged allow-oom, as the heartbeat: it rewrites
# values of the same size, so a full Redis does not make a live worker's folder lapse.
CLAIM_SCRIPT = """#!lua flags=allow-oom
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = redis.call('GET', KEYS[1])
local ours = held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. ' '
if held and not ours and redis.call('ZCARD', KEYS[2]) > 0 then
  return held
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[3])
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]
redis.call('SET', KEYS[1], ARGV[2], 'PXAT', last)
redis.call('PEXPIREAT', KEYS[2], last)
return false
"""

# KEYS: the folder key, its holders. ARGV: the folder id, then holders. Drops their holds; with
# none left, the key too if it names this folder.
RELEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do redis.call('ZREM', KEYS[2], ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = redis.call('GET', KEYS[1])
local ours = held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. ' '
if ours and redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
end
return 0
"""


@dataclass(frozen=True)
class DataFolder:
    """A data folder as a worker sees it: its id, and where (``host:path``) for messages."""

    id: str
    where: str

    @classmethod
    def of(cls, data_dir: Path) -> DataFolder:
        path = data_dir.resolve()
        return cls(folder_id(path), f"{socket.gethostname()}:{path}")

    @property
    def value(self) -> str:
        """The folder as :data:`~worker.constants.DATA_FOLDER_KEY` holds it: ``id host:path``."""
        return f"{self.id} {self.where}"

    @classmethod
    def read(cls, value: bytes | str) -> DataFolder:
        """The folder a :attr:`value` names, as Redis answers it."""
        folder_id, _, where = (value.decode() if isinstance(value, bytes) else value).partition(" ")
        return cls(folder_id, where)


def folder_id(data_dir: Path) -> str:
    """``data_dir``'s id, made at random and written the first time it is asked for; two
    processes asking at once read the same one (the file is linked into place whole, never
    over another)."""
    if (known := stored_id(data_dir)) is not None:
        return known
    data_dir.mkdir(parents=True, exist_ok=True)
    made = data_dir / f".{FOLDER_ID_FILE}.{uuid.uuid4().hex}"
    made.write_text(uuid.uuid4().hex + "\n")
    try:
        os.link(made, data_dir / FOLDER_ID_FILE)
    except FileExistsError:
        pass  # another process's, made meanwhile
    finally:
        made.unlink()
    return (data_dir / FOLDER_ID_FILE).read_text().strip()


def stored_id(data_dir: Path) -> str | None:
    """``data_dir``'s id if a worker ever served it, made none (:func:`folder_id` makes one)."""
    try:
        return (data_dir / FOLDER_ID_FILE).read_text().strip()
    except FileNotFoundError:
        return None


def served(client: redis.Redis) -> DataFolder | None:
    """The folder the live workers on ``client``'s Redis serve; None while none holds it."""
    held = client.get(DATA_FOLDER_KEY)
    return DataFolder.read(held) if held else None


def start_holder(pid: int | None = None) -> str:
    """The holder a starting ``sift worker`` (process ``pid``, this one by default) claims by,
    until its processes beat: the first beat of each drops its own process's and its
    parent's (a supervisor's) such hold."""
    return f"{socket.gethostname()}:{pid or os.getpid()}:start"


def claim(client: redis.Redis, folder: DataFolder, holder: str, hold_seconds: float) -> str | None:
    """Hold the Redis for ``folder`` as ``holder`` for ``hold_seconds``; answers None, or
    (refused, nothing held) the ``host:path`` of the other folder a live holder serves."""
    ttl_ms = max(1, int(hold_seconds * 1000))
    held = client.register_script(CLAIM_SCRIPT)(
        keys=[DATA_FOLDER_KEY, DATA_FOLDER_HOLDERS_KEY],
        args=[folder.id, folder.value, holder, ttl_ms],
    )
    return DataFolder.read(held).where if held else None


def release(client: redis.Redis, folder: DataFolder, *holders: str) -> None:
    """Drop the ``holders``' holds (a clean stop): with none left, any folder may be claimed."""
    client.register_script(RELEASE_SCRIPT)(
        keys=[DATA_FOLDER_KEY, DATA_FOLDER_HOLDERS_KEY], args=[folder.id, *holders]
    )
