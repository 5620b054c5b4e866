"""Dead-worker recovery: a killed worker's deliveries go back to their queue in seconds.

Why. Celery acks late, so a message a worker took stays in kombu's ``unacked`` hash (and
``unacked_index`` zset, by the time it was taken) until its task ends. When the worker is
SIGKILLed (OOM, node drain, spot eviction) nothing requeues it: kombu brings it back only
once it is older than the transport's visibility timeout, which must outlast the longest task
(about 27 minutes at the defaults). That timeout stays as the last resort; this is the
recovery path.

How. Each worker process (:class:`Liveness`, one thread):

- keeps a heartbeat key ``sift:worker-alive:<id>`` that expires after
  ``SIFT_WORKER_DEAD_AFTER_SECONDS``, refreshed every ``SIFT_WORKER_HEARTBEAT_SECONDS`` (on a
  Redis at its ``maxmemory`` too, :data:`BEAT_SCRIPT`), and its id in the ``sift:workers``
  set, so a check finds it dead even holding no delivery;
- on the embedded backend, holds its data folder in Redis at each beat, with the
  heartbeat's TTL, so no worker of another folder starts while it lives
  (:mod:`worker.queue.data_folder`), and drops its hold at a clean stop;
- records which deliveries it holds in the ``sift:deliveries`` hash (delivery tag ->
  worker id): a tag is added as the message is received (``task_received``), written within
  milliseconds, and dropped after its ack or reject (:class:`OwnedRequest`);
- every beat, if it wins the ``SET NX`` lock for that beat, runs :meth:`Reaper.check`:
  a delivery whose owner's heartbeat is gone, on two checks at least two beats apart, goes
  back to its queue; so does an unacked delivery no worker owns once it is older than
  ``SIFT_WORKER_ORPHAN_DELIVERY_SECONDS`` (its worker died between taking it and recording
  it).

A worker that can send an economy batch (it has a generation model and consumes the batch
queue) also sets ``sift:economy-sender`` to its model at each beat, with the heartbeat's TTL:
while the key lives, some such worker does, and a worker without the model leaves the
batch's never-sent items to it past the economy deadline rather than ending them
(:func:`economy_sender_alive`; :mod:`worker.queue.economy.submission`). Each beat reads the
queues the worker consumes as they are then (Celery's selected queues, which an operator's
``celery control cancel_consumer`` or ``add_consumer`` changes at run time): read once at
its start, a worker told to stop consuming the batch queue still said it could send, and the
items waited for it for ever.

The check, how a delivery goes back and what a dead worker can lose that no check puts
back: :mod:`worker.queue.reaper`.

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
once Redis is back. Its thread then drops the records naming it for deliveries it no longer
holds (:meth:`Liveness.forget_released`: a Redis that lost its last writes brings them back
with their acks lost), which leaves those to the orphan check.

    liveness = Liveness(client, worker_id, heartbeat_seconds=2, dead_after_seconds=10,
                        orphan_seconds=60)
    liveness.start()       # the thread; liveness.hold(tag) / liveness.release(tag)
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import redis
from celery.worker.request import Request

from worker.clock import CLOCK, FIRST_READINGS
from worker.constants import (
    BATCH_QUEUE,
    DELIVERY_OWNERS_KEY,
    ECONOMY_SENDER_KEY,
    KOMBU_UNACKED_INDEX_KEY,
    LIVENESS_LEADER_KEY,
    WORKERS_KEY,
)
from worker.observability import metrics
from worker.queue import data_folder
from worker.queue.reaper import Reaper, heartbeat_key

log = logging.getLogger(__name__)

# KEYS: owners. ARGV: worker id, then tags: drop each tag's entry if it still names the worker.
RELEASE_SCRIPT = """
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return 0
"""


# KEYS: the worker's heartbeat, the set of workers, the economy sender's key. ARGV: the beat's
# time, the heartbeat's TTL (ms), the worker id, the model it sends economy batches with ('':
# none, the key left alone; see economy_model). Answers the heartbeat it replaced (nil: there
# was none). Flagged allow-oom: Redis at its maxmemory refuses a SET, so every beat was
# refused while it was full, and after SIFT_WORKER_DEAD_AFTER_SECONDS a live worker read as
# dead (to ``sift status``, and to any check that got through, which put back the deliveries
# it was running). The beat rewrites keys of the same size and a member already there: it adds
# nothing to a full Redis but the keys themselves once, after they expired.
BEAT_SCRIPT = """#!lua flags=allow-oom
local previous = redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'GET')
redis.call('SADD', KEYS[2], ARGV[3])
if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[2]) end
return previous
"""


def economy_model(model: str | None, queues: Collection[str]) -> str | None:
    """The model this worker sends economy batches with: its generation model (``model``)
    if it consumes the batch queue, where the economy lane's submission and polls go; None
    if it cannot send one (no model, or the batch queue is not among ``queues``).

    >>> economy_model("claude-haiku-4-5", ["sift.search", "sift.batch"])
    'claude-haiku-4-5'
    >>> economy_model("claude-haiku-4-5", ["sift.search"]) is None
    True
    """
    return model if BATCH_QUEUE in queues else None


def economy_sender_alive(client: redis.Redis) -> bool:
    """Whether a worker that can send an economy batch lives (its beat, within the
    heartbeat's TTL, set :data:`~worker.constants.ECONOMY_SENDER_KEY`): one Redis read."""
    return bool(client.exists(ECONOMY_SENDER_KEY))


def new_worker_id() -> str:
    """Unique per process start: a restarted process with the same pid is another worker."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


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
        generation_model: str | None = None,
        consumed: Callable[[], Collection[str]] = tuple,
        folder: data_folder.DataFolder | None = None,
    ) -> None:
        self.client = client
        # the embedded data folder it serves, held in Redis by each beat (worker/queue/data_folder)
        self.folder = folder
        self._folder_refused = False
        self._folder_held = False
        # with the batch queue among those consumed at a beat, it says it can send economy
        # batches: read at each beat, since an operator may cancel or add a queue at run time
        self.generation_model = generation_model
        self.consumed = consumed
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
        self._beat_script = client.register_script(BEAT_SCRIPT)
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
            if self.folder is not None:
                data_folder.release(self.client, self.folder, self.worker_id)
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
        """Refresh the heartbeat (and, on a worker that can send economy batches,
        :data:`~worker.constants.ECONOMY_SENDER_KEY`), re-assert the deliveries held (a write
        lost to a Redis restart comes back), write what changed since the last flush, hold
        its data folder (:meth:`hold_folder`), and read Redis's clock again (this process's
        shared clock, :mod:`worker.clock`)."""
        ttl_ms = int(self.dead_after_seconds * 1000)
        # the beat's time on the shared clock, which ``sift status`` reads its age against;
        # written on a full Redis too (BEAT_SCRIPT)
        previous = self._beat_script(
            keys=[heartbeat_key(self.worker_id), WORKERS_KEY, ECONOMY_SENDER_KEY],
            args=[repr(CLOCK.now()), ttl_ms, self.worker_id, self.economy_sender_model() or ""],
        )
        # this process's reading of the shared clock (worker/clock.py): a TIME of its own, its
        # round trip as short as one can be
        metrics.clock_skew("worker", CLOCK.read(self.client.time))
        if previous is None and self._beaten:
            log.error(
                "liveness: this worker's heartbeat had expired (stalled for over %gs, or Redis "
                "lost it); other workers may have taken back its deliveries",
                self.dead_after_seconds,
            )
        self._beaten = True
        self.flush(reassert=True)
        self.hold_folder()

    def hold_folder(self) -> None:
        """Renew this worker's hold of its data folder in Redis (:mod:`worker.queue.data_folder`),
        which keeps workers of another folder from starting; at the first, drop the hold its
        ``sift worker`` took as it started (this process, or its supervisor)."""
        if self.folder is None:
            return
        other = data_folder.claim(self.client, self.folder, self.worker_id, self.dead_after_seconds)
        if other is not None and not self._folder_refused:  # a flushed Redis, claimed meanwhile
            log.error(
                "liveness: a live worker on this Redis serves another data folder, %s: this "
                "one's (%s) splits each index with it; every worker on one Redis must share "
                "one SIFT_DATA_DIR",
                other,
                self.folder.where,
            )
        if other is None and not self._folder_held:  # its own start's, or its supervisor's
            starts = {data_folder.start_holder(pid) for pid in (os.getpid(), os.getppid())}
            data_folder.release(self.client, self.folder, *sorted(starts))
        self._folder_refused = other is not None
        self._folder_held = self._folder_held or other is None

    def economy_sender_model(self) -> str | None:
        """The model this worker sends economy batches with now (:func:`economy_model` of the
        queues it consumes at this beat); None: it cannot send one."""
        return economy_model(self.generation_model, self.consumed())

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


def read_clock_in_child(time_command: Callable[[], Any]) -> None:
    """In a prefork child, read Redis's clock (``time_command``: a client's ``time``) when its
    last reading is older than :data:`~worker.clock.RECALIBRATE_SECONDS`, or there is none;
    a task start's call. The heartbeat thread that reads it every beat is the parent's alone
    (no thread survives a fork): a child kept the reading it was forked with for as long as
    it lived, and none at all when Redis was not up as the worker started (it then timed
    and signed everything on its host's own clock). Elsewhere, nothing: a worker's own
    beats read it. A Redis that does not answer leaves the reading as it was."""
    if _liveness is None or os.getpid() == _liveness_pid or not CLOCK.stale():
        return
    try:
        metrics.clock_skew("worker", CLOCK.read(time_command))
    except redis.RedisError as exc:
        log.warning("liveness: could not read Redis's clock in this process: %s", exc)


def run_owner() -> str:
    """The id a run claim names this process by (:mod:`worker.queue.jobstore.runs`): its
    worker id while this process keeps that heartbeat; '' otherwise (no liveness, or a
    prefork child: its parent's heartbeat outlives the child, so it cannot say the child's
    run is alive, and a claim naming it would hold the job from the child's redelivery)."""
    if _liveness is None or os.getpid() != _liveness_pid:
        return ""
    return _liveness.worker_id


def start(
    redis_url: str, settings: Any, consumed: Callable[[], Collection[str]] = tuple
) -> Liveness:
    """Start this process's heartbeat and reaper (``worker_init``); ``consumed``: the queues
    the worker consumes as they are when called (each beat)."""
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
        generation_model=settings.generation_model_id,
        consumed=consumed,
        folder=(
            data_folder.DataFolder.of(settings.data_dir)
            if settings.search_backend == "embedded"
            else None
        ),
    )
    try:  # on the shared clock before the first task, and before a prefork child is forked
        for _ in range(FIRST_READINGS):  # the surest of a few kept: a busy start's are slow
            metrics.clock_skew("worker", CLOCK.read(client.time))
    except redis.RedisError as exc:  # Redis not up yet: the first beat reads it
        log.warning("liveness: could not read Redis's clock yet: %s", exc)
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
