"""Dead-worker recovery: a killed worker's deliveries go back to their queue in seconds.

Why. Celery acks late, so a message a worker took stays in kombu's ``unacked`` hash (and
``unacked_index`` zset, by the time it was taken) until its task ends. When the worker is
SIGKILLed (OOM, node drain, spot eviction) nothing requeues it: kombu brings it back only
once it is older than the transport's visibility timeout, which must outlast the longest task
(about 27 minutes at the defaults). That timeout stays as the last resort; this is the
recovery path.

How. Each worker process (:class:`Liveness`, one thread):

- keeps a heartbeat key ``sift:worker-alive:<id>`` that expires after
  ``SIFT_WORKER_DEAD_AFTER_SECONDS``, refreshed every ``SIFT_WORKER_HEARTBEAT_SECONDS``, and
  its id in the ``sift:workers`` set, so a check finds it dead even holding no delivery;
- records which deliveries it holds in the ``sift:deliveries`` hash (delivery tag ->
  worker id): a tag is added as the message is received (``task_received``), written within
  milliseconds, and dropped after its ack or reject (:class:`OwnedRequest`);
- every beat, if it wins the ``SET NX`` lock for that beat, runs :meth:`Reaper.check`:
  a delivery whose owner's heartbeat is gone, on two checks at least two beats apart, goes
  back to its queue; so does an unacked delivery no worker owns once it is older than
  ``SIFT_WORKER_ORPHAN_DELIVERY_SECONDS`` (its worker died between taking it and recording
  it).

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

A live worker whose broker connection dropped (Redis restarted, say) puts back its own: Celery
drops every request it held that had not gone to the pool (a countdown waiting on its timer,
one held back by a rate limit; their delivery tags belonged to the lost channel), and kombu's
restore at the channel's close fails while Redis is down, so their messages stay in
``unacked`` with no one to run them until the visibility timeout. As its consumer starts
again, before it takes anything on the new connection, the worker notes those held requests
never handed to the pool (:meth:`Liveness.reconnected`; :class:`OwnedRequest` says which
went) and its thread puts them back at once with the same script, on the same conditions
but its own heartbeat (:meth:`Reaper.put_back_own`), each only while its ``unacked_index``
take time is still the one the worker read as it recorded the delivery: one acked, already
put back, or taken again since, by any worker (kombu's close put it back while Redis stayed
up), is left alone. One whose take time it never read (Redis went down within milliseconds
of the take) is left to the orphan check. A running task's message stays; the task acks it
once Redis is back.

A dead worker may also have lost a message no check can put back: one it had popped but not
yet recorded in ``unacked`` (kombu's pop-then-record window). Only the re-drive
(:mod:`worker.queue.redrive`) recovers that one, so a check that finds a worker dead, even
with nothing to put back, opens the re-drive's urgent window: its next two sweeps look at
every active job, and the lost positions go out again within an interval or two instead of
once their whole batch has gone idle. A dead worker then leaves ``sift:workers``.

    liveness = Liveness(client, worker_id, heartbeat_seconds=2, dead_after_seconds=10,
                        orphan_seconds=60)
    liveness.start()       # the thread; liveness.hold(tag) / liveness.release(tag)
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
from celery.worker.request import Request

from worker.constants import (
    ALL_QUEUES,
    DELIVERY_OWNERS_KEY,
    KOMBU_BINDING_PREFIX,
    KOMBU_PRIORITY_SEPARATOR,
    KOMBU_UNACKED_INDEX_KEY,
    KOMBU_UNACKED_KEY,
    LIVENESS_LEADER_KEY,
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

# KEYS: owners. ARGV: worker id, then tags: drop each tag's entry if it still names the worker.
RELEASE_SCRIPT = """
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return 0
"""


def new_worker_id() -> str:
    """Unique per process start: a restarted process with the same pid is another worker."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``redrive_interval_seconds`` is the re-drive's ``SIFT_REDRIVE_INTERVAL_SECONDS``,
        for the urgent window a dead worker opens (0: the re-drive is off, no window).
        ``clock`` times the beats between checks (seconds, never going back)."""
        self.client = client
        self.clock = clock
        self.heartbeat_seconds = heartbeat_seconds
        self.dead_after_seconds = dead_after_seconds
        self.orphan_seconds = orphan_seconds
        self.redrive_interval_seconds = redrive_interval_seconds
        self._restore = client.register_script(RESTORE_SCRIPT)
        self._suspects: dict[str, float] = {}  # worker id -> when first found without a beat
        self._announced: set[str] = set()  # dead workers this check opened a window for
        self._last_check = 0.0
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
        cutoff = time.time() - self.orphan_seconds
        taken_long_ago = cast(
            list[str], self.client.zrangebyscore(KOMBU_UNACKED_INDEX_KEY, "-inf", cutoff)
        )
        doomed += [(tag, "") for tag in taken_long_ago if tag not in owners]
        if not doomed:
            return {}
        doomed, raws = self._first_taken_last(doomed)
        # A dead worker took nothing in its last TTL: a delivery taken since then is another
        # worker's, requeued and taken again, whose record of it is still on its way.
        dead_cutoff = time.time() - self.dead_after_seconds
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
        now = self.clock()
        if now - self._last_check > 3 * self.heartbeat_seconds:
            self._suspects = {}  # another worker led meanwhile: what this one saw is stale
        self._last_check = now
        missing = {name for name, alive in zip(names, beating, strict=True) if not alive}
        self._suspects = {name: self._suspects.get(name, now) for name in missing}
        settle = 2 * self.heartbeat_seconds
        return {name for name, since in self._suspects.items() if now - since >= settle}

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


class Liveness:
    """One worker process's heartbeat and record of held deliveries (see the module doc)."""

    def __init__(
        self,
        client: redis.Redis,
        worker_id: str,
        *,
        heartbeat_seconds: float,
        dead_after_seconds: float,
        orphan_seconds: float,
        redrive_interval_seconds: float = 0.0,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.heartbeat_seconds = heartbeat_seconds
        self.dead_after_seconds = dead_after_seconds
        self.reaper = Reaper(
            client,
            heartbeat_seconds=heartbeat_seconds,
            dead_after_seconds=dead_after_seconds,
            orphan_seconds=orphan_seconds,
            redrive_interval_seconds=redrive_interval_seconds,
        )
        self._release_script = client.register_script(RELEASE_SCRIPT)
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._unrecorded: set[str] = set()  # held, not yet written
        self._released: set[str] = set()  # written, then acked: to drop
        self._writing: set[str] = set()  # being written by the flush in progress
        self._requests: dict[str, Any] = {}  # held tag -> its Celery request, if given
        self._taken: dict[str, float] = {}  # held tag -> its take time, read as it was written
        # held on a lost channel, never run, to put back: tag -> (its request, its take time)
        self._dropped: dict[str, tuple[Any, float | None]] = {}
        self._recheck = False  # after a reconnect: drop records of deliveries no longer held
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beaten = False

    # --- what the consumer and the tasks call -----------------------------------------------

    def hold(self, tag: str, request: Any = None) -> None:
        """A delivery was received: record it (within milliseconds, off this thread)."""
        with self._lock:
            self._held.add(tag)
            self._unrecorded.add(tag)
            self._released.discard(tag)  # taken again after its release: the record stays
            self._requests[tag] = request
            self._taken.pop(tag, None)  # this take's time is read as it is written
        self._wake.set()

    def release(self, tag: str) -> None:
        """A delivery was acked or rejected: drop its record at the next beat."""
        with self._lock:
            self._release(tag)

    def reconnected(self) -> None:
        """The consumer starts again on a new broker connection (before it takes anything on
        it): every delivery held whose request never went to the pool was dropped by Celery
        with the lost channel (a countdown waiting on its timer, one a rate limit held). Nothing
        would run it before the visibility timeout, so the thread puts each back now."""
        with self._lock:
            dropped = {
                tag: (request, self._taken.get(tag))
                for tag, request in self._requests.items()
                if request is not None and not getattr(request, "handed", True)
            }
            self._dropped.update(dropped)
            self._recheck = True
        self._wake.set()

    def put_back_dropped(self) -> list[str]:
        """Put back the deliveries :meth:`reconnected` found dropped (idempotent: one acked,
        put back or taken again since, by any worker, is left alone) and forget them. One
        whose take time was never read is left to the orphan check. Answers those put back;
        a Redis error leaves them all for the next round."""
        with self._lock:
            dropped = dict(self._dropped)
        if not dropped:
            return []
        taken = {tag: at for tag, (_, at) in dropped.items() if at is not None}
        restored = self.reaper.put_back_own(self.worker_id, taken)
        with self._lock:
            for tag, (request, _) in dropped.items():
                if self._dropped.get(tag, (None,))[0] is request:
                    del self._dropped[tag]
                if self._requests.get(tag) is request:  # not held again since (same tag)
                    self._release(tag)
        return restored

    def forget_released(self) -> list[str]:
        """After a reconnect, drop the records that name this worker for deliveries it no
        longer holds. A Redis that lost its last writes (a host crash with ``appendfsync
        everysec``, or a SIGKILL while a slow fsync held the file's writes back) comes back
        with the messages whose acks and record drops it lost still ``unacked`` and recorded
        as this live worker's: no check put them back before the visibility timeout (about
        27 minutes), while their jobs, whose finishes were lost too, read ``running``. With
        their records gone they are orphans, put back by the next check once taken
        ``SIFT_WORKER_ORPHAN_DELIVERY_SECONDS`` ago; one whose ack was kept is no longer
        ``unacked`` and nothing is put back. Answers the tags whose records it dropped; a
        Redis error leaves the work for the next round."""
        with self._lock:
            if not self._recheck:
                return []
        owners = cast(dict[str, str], self.client.hgetall(DELIVERY_OWNERS_KEY))
        with self._lock:  # a tag held now is recorded by the flush: only the others go
            stale = sorted(
                tag for tag, owner in owners.items() if owner == self.worker_id
                and tag not in self._held
            )  # fmt: skip
        if stale:
            self._release_script(keys=[DELIVERY_OWNERS_KEY], args=[self.worker_id, *stale])
            log.warning(
                "liveness: %d delivery(ies) recorded as this worker's after the reconnect are "
                "no longer held (their acks lost with Redis's last writes?): left to the "
                "orphan check",
                len(stale),
            )
        with self._lock:
            self._recheck = False
        return stale

    def _release(self, tag: str) -> None:
        """:meth:`release`, under the lock."""
        if tag not in self._held:
            return
        self._held.discard(tag)
        self._requests.pop(tag, None)
        self._taken.pop(tag, None)
        never_written = tag in self._unrecorded and tag not in self._writing
        self._unrecorded.discard(tag)
        if not never_written:
            self._released.add(tag)

    # --- the thread -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sift-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and say so: the deliveries still recorded as ours (none, after a warm
        shutdown) are put back by the next check instead of after the heartbeat's TTL."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.flush()
            self.client.delete(heartbeat_key(self.worker_id))
            self.client.srem(WORKERS_KEY, self.worker_id)  # a clean stop is no death
        except redis.RedisError as exc:
            log.warning("liveness: could not remove the heartbeat at shutdown: %s", exc)

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            self._wake.clear()  # before the work: a hold() during it wakes the next round
            try:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_seconds
                    self.beat()
                    if self._lead():
                        self.reaper.check()
                else:
                    self.flush()
                self.put_back_dropped()  # after a reconnect: at once, not at the next beat
                self.forget_released()
            except Exception as exc:  # Redis restarting, say: the next beat tries again
                log.warning("liveness: %s", exc)
            self._wake.wait(max(0.0, next_beat - time.monotonic()))

    def beat(self) -> None:
        """Refresh the heartbeat, re-assert the deliveries held (a write lost to a Redis
        restart comes back), and write what changed since the last flush."""
        ttl_ms = int(self.dead_after_seconds * 1000)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(heartbeat_key(self.worker_id), str(time.time()), px=ttl_ms, get=True)
        pipe.sadd(WORKERS_KEY, self.worker_id)
        previous, _ = pipe.execute()
        if previous is None and self._beaten:
            log.error(
                "liveness: this worker's heartbeat had expired (stalled for over %gs, or Redis "
                "lost it); other workers may have taken back its deliveries",
                self.dead_after_seconds,
            )
        self._beaten = True
        self.flush(reassert=True)

    def flush(self, *, reassert: bool = False) -> None:
        with self._lock:
            new, gone = set(self._unrecorded), set(self._released)
            held = set(self._held) if reassert else set()
            self._writing = new
        if not (new or gone or held):
            return
        pipe = self.client.pipeline(transaction=False)
        for tag in held - new:
            pipe.hsetnx(DELIVERY_OWNERS_KEY, tag, self.worker_id)
        if new:
            pipe.hset(DELIVERY_OWNERS_KEY, mapping=dict.fromkeys(new, self.worker_id))
        if gone:
            self._release_script(
                keys=[DELIVERY_OWNERS_KEY], args=[self.worker_id, *sorted(gone)], client=pipe
            )
        written = sorted(new)
        for tag in written:  # its take time, for a put-back of this take only
            pipe.zscore(KOMBU_UNACKED_INDEX_KEY, tag)
        try:
            replies = pipe.execute()
        finally:
            with self._lock:
                self._writing = set()
        scores = replies[len(replies) - len(written) :]
        with self._lock:
            self._unrecorded -= new
            self._released -= gone
            for tag, score in zip(written, scores, strict=True):
                if score is not None and tag in self._held:
                    self._taken[tag] = float(score)

    def _lead(self) -> bool:
        lock_ms = max(1, int(self.heartbeat_seconds * 1000))
        return bool(self.client.set(LIVENESS_LEADER_KEY, self.worker_id, nx=True, px=lock_ms))

    @property
    def held(self) -> Sequence[str]:
        with self._lock:
            return sorted(self._held)


# --- the process's one Liveness, and the Celery hooks -----------------------------------------

_liveness: Liveness | None = None
_liveness_pid = 0  # the process that started it (a prefork child has a copy, not the thread)


def current() -> Liveness | None:
    return _liveness


def run_owner() -> str:
    """The id a run claim names this process by (:mod:`worker.queue.jobstore.runs`): its
    worker id while this process keeps that heartbeat; '' otherwise (no liveness, or a
    prefork child: its parent's heartbeat outlives the child, so it cannot say the child's
    run is alive, and a claim naming it would hold the job from the child's redelivery)."""
    if _liveness is None or os.getpid() != _liveness_pid:
        return ""
    return _liveness.worker_id


def start(redis_url: str, settings: Any) -> Liveness:
    """Start this process's heartbeat and reaper (``worker_init``)."""
    global _liveness, _liveness_pid
    client = redis.Redis.from_url(
        redis_url,
        decode_responses=True,
        socket_timeout=max(2.0, settings.worker_heartbeat_seconds),
        socket_connect_timeout=2.0,
        health_check_interval=30,
    )
    _liveness = Liveness(
        client,
        new_worker_id(),
        heartbeat_seconds=settings.worker_heartbeat_seconds,
        dead_after_seconds=settings.worker_dead_after_seconds,
        orphan_seconds=settings.worker_orphan_delivery_seconds,
        redrive_interval_seconds=settings.redrive_interval_seconds,
    )
    _liveness.start()
    _liveness_pid = os.getpid()
    log.info(
        "liveness: worker %s beating every %gs; a worker silent %gs is dead",
        _liveness.worker_id,
        settings.worker_heartbeat_seconds,
        settings.worker_dead_after_seconds,
    )
    return _liveness


def stop() -> None:
    """Stop this process's heartbeat (``worker_shutdown``)."""
    global _liveness
    if _liveness is not None:
        _liveness.stop()
        _liveness = None


def received(request: Any = None, **_: Any) -> None:
    """``task_received``: record the delivery as this worker's."""
    liveness = _liveness
    tag = getattr(getattr(request, "message", None), "delivery_tag", None)
    if liveness is not None and tag is not None:
        liveness.hold(str(tag), request)


def reconnected() -> None:
    """The worker's consumer starts again after a lost broker connection
    (:class:`~worker.queue.redrive.ReconnectStep`): put back what it dropped."""
    if _liveness is not None:
        _liveness.reconnected()


class OwnedRequest(Request):  # type: ignore[misc]
    """Celery's request, which also drops the delivery's record once it is acked or
    rejected (``SiftTask.Request``), and says whether it went to the pool (``handed``): one
    that did runs and acks; one that did not when its channel was lost never will."""

    handed = False

    def execute_using_pool(self, pool: Any, **kwargs: Any) -> Any:
        self.handed = True
        return super().execute_using_pool(pool, **kwargs)

    def acknowledge(self) -> None:
        super().acknowledge()
        self._release()

    def reject(self, requeue: bool = False) -> None:
        super().reject(requeue)
        self._release()

    def _release(self) -> None:
        liveness = _liveness
        tag = getattr(self.message, "delivery_tag", None)
        if liveness is not None and tag is not None:
            liveness.release(str(tag))
