"""The dead-worker check (:class:`Reaper`): a dead or orphaned delivery goes back to its queue.

Each worker process's :class:`~worker.queue.liveness.Liveness` thread runs a check every
beat it wins the lock for (see that module for the heartbeats and the records it reads).

The restore is one Lua script per delivery (:data:`RESTORE_SCRIPT`), mirroring kombu's own
restore: remove the tag from ``unacked`` and ``unacked_index`` and push the message (marked
``redelivered``) back onto its queue, all at once, and only if the message is still the one
read, the owner is still the dead one and its heartbeat is still missing. kombu's restores
WATCH ``unacked``, so whichever of two restores comes second finds nothing to restore: a
message is never requeued twice. A slow worker whose heartbeat is alive keeps its messages.
Each goes back onto the end of its queue that ``BRPOP`` takes from, the last taken first: taken
again before every message waiting, the first taken first (the queue stays first in, first out).

The job store's compare-and-set still keeps one result per item: a restored chunk takes
over the items the dead worker left ``running`` and skips the ones it finished.

A dead worker may also have lost a message no check can put back: one it had popped but not
yet recorded in ``unacked`` (kombu's pop-then-record window). Only the re-drive
(:mod:`worker.queue.redrive`) recovers that one, so a check that finds a worker dead, even
with nothing to put back, opens the re-drive's urgent window: its next two sweeps look at
every active job, and the lost positions go out again within an interval or two instead of
once their whole batch has gone idle. A dead worker then leaves ``sift:workers``.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import redis

from worker import clock as shared_clock
from worker.constants import (
    ALL_QUEUES,
    DELIVERY_OWNERS_KEY,
    KOMBU_BINDING_PREFIX,
    KOMBU_PRIORITY_SEPARATOR,
    KOMBU_UNACKED_INDEX_KEY,
    KOMBU_UNACKED_KEY,
    LIVENESS_SUSPECTS_KEY,
    WORKER_HEARTBEAT_KEY,
    WORKERS_KEY,
)
from worker.queue.urgent_window import open_urgent_window

log = logging.getLogger(__name__)

PRIORITY_STEPS = (0, 3, 6, 9)  # kombu's Redis PRIORITY_STEPS

# KEYS: unacked, unacked_index, owners, the owner's heartbeat, then the lists to push onto.
# ARGV: tag, the raw unacked entry read, the message to push, the owner read ("" for none),
#       the latest take time (unacked_index score) that may be restored, and "own" when the
#       owner itself puts back what its lost channel held (its heartbeat is then no reason to
#       keep it, and a record of it that a Redis restart lost, "", is its own too; the take
#       time is then the one it read for its own take, and must be the score still there).
# Answers 1 when it restored the message, 0 when anything changed since it was read.
RESTORE_SCRIPT = """
local owner = redis.call('HGET', KEYS[3], ARGV[1]) or ''
local own = ARGV[6] == 'own'
if owner ~= ARGV[4] and not (own and owner == '') then return 0 end
if not own and owner ~= '' and redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw ~= ARGV[2] then
  if not raw and owner ~= '' then redis.call('HDEL', KEYS[3], ARGV[1]) end
  return 0
end
local taken = redis.call('ZSCORE', KEYS[2], ARGV[1])
if own then
  if not taken or tonumber(taken) ~= tonumber(ARGV[5]) then return 0 end
elseif taken and tonumber(taken) > tonumber(ARGV[5]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
for i = 5, #KEYS do redis.call('RPUSH', KEYS[i], ARGV[3]) end
return 1
"""


# Which workers the checks have found without a heartbeat, and since when, kept in Redis for
# whichever worker checks next (the lock passes from one to another between beats).
# KEYS: the suspects hash. ARGV: 1 the check's time (seconds; "" for Redis's own clock), 2 how
# long a worker must have been missing to be dead, 3 how long after the last check what it saw
# is still current, 4 the hash's time to live (ms), 5.. the workers without a heartbeat now.
# Answers those missing for at least ARGV[2]; the hash keeps only the ones missing now.
SUSPECTS_SCRIPT = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local last = tonumber(redis.call('HGET', KEYS[1], '~last') or '')
local current = last ~= nil and now - last <= tonumber(ARGV[3])
local kept, dead = {'~last', tostring(now)}, {}
for i = 5, #ARGV do
  local since = current and tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '') or nil
  since = since or now
  kept[#kept + 1] = ARGV[i]
  kept[#kept + 1] = tostring(since)
  if now - since >= tonumber(ARGV[2]) then dead[#dead + 1] = ARGV[i] end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(kept))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return dead
"""


def heartbeat_key(worker_id: str) -> str:
    return WORKER_HEARTBEAT_KEY + worker_id


@dataclass(frozen=True, slots=True)
class Restore:
    """How to put one unacked entry back: the lists to push onto and the message to push."""

    queues: list[str]
    message: str


def plan_restore(client: redis.Redis, raw: str) -> Restore | None:
    """What kombu's ``_do_restore_message`` would push for an ``unacked`` entry (``[message,
    exchange, routing key]``): the message marked redelivered, onto each queue its exchange
    binds the routing key to, in the list of its priority. None if it names no Sift queue."""
    try:
        message, exchange, routing_key = json.loads(raw)
    except (ValueError, TypeError):
        return None
    try:
        message["headers"]["redelivered"] = True
        message["properties"]["delivery_info"]["redelivered"] = True
    except (KeyError, TypeError):
        pass
    queues = _bound_queues(client, exchange, routing_key)
    if not queues:
        return None
    try:
        priority = max(min(int(message["properties"]["priority"]), 9), 0)
    except (KeyError, TypeError, ValueError):
        priority = 0
    step = PRIORITY_STEPS[bisect.bisect(PRIORITY_STEPS, priority) - 1]
    suffix = f"{KOMBU_PRIORITY_SEPARATOR}{step}" if step else ""
    return Restore([queue + suffix for queue in queues], json.dumps(message))


def _bound_queues(client: redis.Redis, exchange: str, routing_key: str) -> list[str]:
    """kombu's direct-exchange lookup: the binding set's queues for ``routing_key``; the
    anonymous exchange routes to the queue the key names. Sift's exchanges are direct and
    named like their queue, so a missing binding falls back to that queue."""
    if exchange:
        members = cast(set[str], client.smembers(KOMBU_BINDING_PREFIX + exchange))
        queues = sorted(
            parts[2]
            for parts in (m.split(KOMBU_PRIORITY_SEPARATOR) for m in members)
            if len(parts) == 3 and parts[0] == routing_key
        )
        if queues:
            return queues
    return [routing_key] if routing_key in ALL_QUEUES else []


class Reaper:
    """Puts back the deliveries of dead workers and orphaned ones (see the module doc)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        heartbeat_seconds: float,
        dead_after_seconds: float,
        orphan_seconds: float,
        redrive_interval_seconds: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``redrive_interval_seconds`` is the re-drive's ``SIFT_REDRIVE_INTERVAL_SECONDS``,
        for the urgent window a dead worker opens (0: the re-drive is off, no window).
        ``clock`` times the beats between checks (seconds, never going back; every checker's
        the same): Redis's own clock when None, as every worker's check shares it."""
        self.client = client
        self.clock = clock
        self._suspects_script = client.register_script(SUSPECTS_SCRIPT)
        self.heartbeat_seconds = heartbeat_seconds
        self.dead_after_seconds = dead_after_seconds
        self.orphan_seconds = orphan_seconds
        self.redrive_interval_seconds = redrive_interval_seconds
        self._restore = client.register_script(RESTORE_SCRIPT)
        self._announced: set[str] = set()  # dead workers this check opened a window for
        self._unroutable: set[str] = set()

    def check(self) -> dict[str, int]:
        """One check: answers how many deliveries went back, by former owner ("" for none).

        A worker counts as dead once it has been without a heartbeat on checks at least two
        beats apart: after a Redis outage longer than the heartbeat's TTL, every worker looks
        dead on the first check, and each has beaten again by the next."""
        owners = cast(dict[str, str], self.client.hgetall(DELIVERY_OWNERS_KEY))
        holding = set(owners.values())
        dead = self._dead_workers(holding | cast(set[str], self.client.smembers(WORKERS_KEY)))
        self._announce(dead, holding)
        doomed = [(tag, owner) for tag, owner in owners.items() if owner in dead]
        # the take times are on the shared clock, as every worker's kombu writes them
        # (celery_app.deliveries_on_the_shared_clock): read against this host's own, a
        # worker minutes ahead put back deliveries just taken, whose record was on its way
        cutoff = shared_clock.now() - self.orphan_seconds
        taken_long_ago = cast(
            list[str], self.client.zrangebyscore(KOMBU_UNACKED_INDEX_KEY, "-inf", cutoff)
        )
        doomed += [(tag, "") for tag in taken_long_ago if tag not in owners]
        if not doomed:
            return {}
        doomed, raws = self._first_taken_last(doomed)
        # A dead worker took nothing in its last TTL: a delivery taken since then is another
        # worker's, requeued and taken again, whose record of it is still on its way.
        dead_cutoff = shared_clock.now() - self.dead_after_seconds
        restored: dict[str, int] = {}
        for (tag, owner), raw in zip(doomed, raws, strict=True):
            if self._put_back(tag, owner, raw, dead_cutoff if owner else cutoff):
                restored[owner] = restored.get(owner, 0) + 1
        for owner, count in restored.items():
            log.warning(
                "%d delivery(ies) of %s put back on their queues",
                count,
                f"dead worker {owner}" if owner else "no worker (orphaned)",
            )
        return restored

    def _first_taken_last(
        self, doomed: list[tuple[str, str]]
    ) -> tuple[list[tuple[str, str]], list[str | None]]:
        """``doomed`` in the order to put back, each with its ``unacked`` entry: the last taken
        first. Each goes onto the end of its queue that ``BRPOP`` takes from, so the first
        taken is taken again first, ahead of every message waiting (first in, first out)."""
        pipe = self.client.pipeline(transaction=False)
        for tag, _ in doomed:
            pipe.zscore(KOMBU_UNACKED_INDEX_KEY, tag)
        pipe.hmget(KOMBU_UNACKED_KEY, [tag for tag, _ in doomed])
        *taken, raws = pipe.execute()
        order = sorted(range(len(doomed)), key=lambda i: taken[i] or 0.0, reverse=True)
        return [doomed[i] for i in order], [raws[i] for i in order]

    def _announce(self, dead: set[str], holding: set[str]) -> None:
        """Open the re-drive's urgent window for workers newly found dead: each may have lost
        a message it popped and never recorded. Once per worker while it still holds
        deliveries, so one that cannot go back yet does not reopen it every beat; a dead
        worker leaves the set of workers (a live one that was only stalled joins it again at
        its next beat)."""
        self._announced &= holding
        new = dead - self._announced
        if not new:
            return
        self._announced |= new & holding
        self.client.srem(WORKERS_KEY, *sorted(new))
        open_urgent_window(
            self.client,
            self.redrive_interval_seconds,
            f"worker {', '.join(sorted(new))} found dead",
        )

    def _dead_workers(self, workers: set[str]) -> set[str]:
        names = sorted(workers)
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.exists(heartbeat_key(name))
        beating = pipe.execute()
        missing = [name for name, alive in zip(names, beating, strict=True) if not alive]
        # kept in Redis, not in this process: the lock passes between the workers' beats, and
        # a checker that found its own view stale each time it led again (it had not led for
        # three beats) found nobody dead while the lead went round (32 s for a SIGKILLed one
        # of two processes at load 17; never, with four processes leading in turn)
        now = "" if self.clock is None else repr(self.clock())
        hb = self.heartbeat_seconds
        args = [now, repr(2 * hb), repr(3 * hb), str(max(1, int(10 * hb * 1000))), *missing]
        dead = self._suspects_script(keys=[LIVENESS_SUSPECTS_KEY], args=args)
        return {name if isinstance(name, str) else name.decode() for name in dead}

    def put_back_own(self, owner: str, taken: Mapping[str, float]) -> list[str]:
        """Put back the deliveries that ``owner``, a live worker, held on a broker channel it
        lost and will never run (Celery dropped them at the reconnect), the last taken first;
        ``taken`` maps each tag to its take time as ``owner`` read it (its ``unacked_index``
        score). Each goes back only while that is still its take time, so it is still the
        unacked message ``owner`` took. Answers the tags restored; the others were acked, put
        back already (kombu's close, when Redis stayed up), or taken again since by any worker
        (a later take has another score)."""
        if not taken:
            return []
        doomed, raws = self._first_taken_last([(tag, owner) for tag in sorted(taken)])
        restored = [
            tag
            for (tag, _), raw in zip(doomed, raws, strict=True)
            if raw is not None and self._put_back(tag, owner, raw, taken[tag], own=True)
        ]
        if restored:
            log.warning(
                "%d delivery(ies) this worker held on its lost broker channel put back on "
                "their queues",
                len(restored),
            )
        return restored

    def _put_back(
        self, tag: str, owner: str, raw: str | None, latest: float, *, own: bool = False
    ) -> bool:
        restore = plan_restore(self.client, raw) if raw is not None else None
        if raw is not None and restore is None:
            if tag not in self._unroutable:  # said once, not every beat
                self._unroutable.add(tag)
                log.error("unacked delivery %s names no Sift queue; left to kombu", tag)
            return False
        queues = restore.queues if restore else []
        keys = [
            KOMBU_UNACKED_KEY,
            KOMBU_UNACKED_INDEX_KEY,
            DELIVERY_OWNERS_KEY,
            heartbeat_key(owner) if owner else DELIVERY_OWNERS_KEY,
            *queues,
        ]
        args = [tag, raw or "", restore.message if restore else "", owner, repr(latest)]
        args.append("own" if own else "")
        return bool(self._restore(keys=keys, args=args))
