"""Run claims: which run of a search or a batch item may make its model call, and how much
of the search's one deadline its runs have used; and which run of an ingest-kind job (an
upsert, a delete, a drop) or of a batch chunk task may run it, its time and answer unused.

Why. A message can be delivered twice while its first run is still going: kombu's
visibility-timeout restore, a re-drive, a client's publish sent again. The status
compare-and-set keeps one result, but both runs started (``running`` may start again, so a
dead worker's item is taken over), and each paid for a model call. And a task retry or a
redelivery ran the search under a fresh deadline, so a search could run for several
deadlines in all.

How. Just before its search starts (after a batch item's pacing), a run claims the item:
one script (:data:`~worker.queue.jobstore.scripts._CLAIM_RUN`) that refuses while another run
holds the claim, its worker's heartbeat alive (:mod:`worker.queue.liveness`) and its lease
(its worker's search deadline, kept in the claim, so that workers with different deadlines
judge it alike) not over, and otherwise records this run. A run that is refused makes
no model call: the run holding the claim finishes the item. Nor does it change anything the
job shows: a search's run claims before it writes its start (``started_at``, ``running``)
and before its delivery is counted (a copy refused is no lost worker, never poison),
and a batch item's start, written before its pacing and its claim, is refused, writing
nothing, while another run holds the claim as this script would judge it. The claim also
adds up the time the search's runs have run, in Redis's clock: a run's deadline is what is
left of the one deadline (:class:`~worker.core.budget.Deadline`'s ``spent``), and the task
retries only while some is left. The waits between runs (a retry's backoff, a batch chunk's retry
waiting for its other items, the queue) are not counted, as the wait before the first run
is not, nor the run's wait for its CPU slot: the pipeline tells the run's keeper once the
slot is held (:meth:`ClaimAnswers.slot_held`), and after a wait of a second or more the claim
is sent again with the run's own token, which the script answers as that run starting now
(its lease and its time restart there, where its deadline starts: a run that waited past its
lease was taken over by a copy of its message, a second paid model call; a run whose claim a
copy took over all the same, its wait longer than its lease, stops there, before its retrieval,
and writes nothing). Nor is a run taken
over (its worker died, or its lease is over): how long it ran
is unknown, and counting it until the takeover (the dead-worker check, then the redelivered
message's wait behind the rest of its batch) failed a killed worker's in-flight batch items
``deadline_exceeded`` by the hundreds, where the next worker finishes them.

A run that leaves its search unfinished (a task retry) lets its claim go, adding its time,
before it sends the retry (which another thread may take half a second later); a batch item's
run handed back by its stopping worker, billed nothing, lets it go adding none (the next run
starts it again whole, as after a takeover); one that finishes it need not (the search is final:
no run starts again). A worker killed mid-run leaves its claim: its heartbeat expires within
``SIFT_WORKER_DEAD_AFTER_SECONDS``, which is when :mod:`worker.queue.liveness` puts its messages
back, and the redelivered run takes the claim over with what the runs that ended left of the
deadline. A process without a heartbeat of its own (no liveness thread, or a prefork child,
whose parent's heartbeat outlives it: :func:`worker.queue.liveness.run_owner`) claims with no
owner: its time is counted when it lets go, nothing is excluded. A run that ended, its end lost
with Redis's last writes, leaves a claim naming its live worker: that worker's store knows it
holds it no more (:class:`RunRecords`), and its copy takes it over at once.

The claim also keeps the model's answer. A worker killed after its model call returned,
before the result was saved, had the redelivered run call the model again: the cost paid
twice. The run saves the answer (the positions, the usage and cost, the attempts: a few
hundred bytes) into its claim as soon as the call returns, one round trip
(:meth:`RunRecords.keep_answer`, on a Redis at its ``maxmemory`` too); a run taking the
claim over is answered it by the claim itself, and finishes the search on it with no model
call (nothing counted again: the calls were counted by the run that made them), if it was
shown the same candidates. A run that
lets go (to be retried: its retrieval failed before it reached the answer) carries it on to
its retry, which dropping it had pay for the call again; the job's (or the item's) final
move drops it, in the same script. An answer that came while Redis was unreachable (the keep
gave up after the client's retries) is held by the run (:class:`ClaimAnswers`, a few hundred
bytes), and a run Redis then ended keeps it once Redis answers again, before its task ends
(:mod:`~worker.queue.jobstore.outages`): the copy finishes on it, where it called the model
again, a second bill for one search.

    claim = store.claim_item(batch_id, query_id, owner, lease_seconds=30.0)
    if claim.granted:
        try: run(spent=claim.spent, answers=store.item_answers(batch_id, query_id, claim))
        finally: store.release_item(batch_id, query_id, claim)
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import redis

from worker.constants import (
    BATCH_CHUNK_RUNS_KEY,
    BATCH_KEY,
    BATCH_LOST_KEY,
    BATCH_RUNS_KEY,
    INGEST_KEY,
    SEARCH_KEY,
    WORKER_HEARTBEAT_KEY,
)
from worker.errors import HandedBack, RunTakenOver
from worker.queue.jobstore.store import _StoreCore

log = logging.getLogger(__name__)


# A run that waited longer than this for its CPU slot sends its claim again once it holds
# one (ClaimAnswers.slot_held): shorter waits cost less than that round trip is worth.
SLOT_WAIT_RESTARTS_CLAIM_SECONDS = 1.0


@dataclass(slots=True)
class RunClaim:
    """A claim's answer: ``granted`` (this run may go on), ``spent`` (the seconds the
    search's earlier runs ran, in Redis's clock: the deadline's time they used), this run's
    ``token``, ``local_at``, this process's monotonic clock at the claim (what
    :meth:`spent_now` adds to ``spent``), ``answer``: the model's answer an earlier run
    kept in the claim (JSON; '' : none), and the ``owner`` and ``lease`` it was claimed with.
    ``spent``, ``local_at`` and ``answer`` change when the run's claim restarts once its CPU
    slot is held (:meth:`ClaimAnswers.slot_held`): the task and its keeper share it."""

    granted: bool
    spent: float
    token: str
    local_at: float
    answer: str = ""
    owner: str = ""
    lease: float = 0.0
    lost: int = 0  # a batch item's runs lost so far (taken over from a dead worker)

    def spent_now(self) -> float:
        """The deadline's time spent by now, earlier runs included."""
        return self.spent + time.monotonic() - self.local_at


@dataclass(frozen=True, slots=True)
class ClaimAnswers:
    """A run claim as the pipeline's :class:`~worker.core.ports.AnswerKeeper`: the answer
    the claim came with, and where this run keeps its own. Its ``figures`` (the search's
    retrieval's, its outcome and duration, its model answer's) wait for :meth:`record`,
    which the task calls once this run's move of the search is made (its result saved, its
    retry queued, or the cancel of a batch item stopped before its model call): a run dying
    between the two leaves them to the run that finishes the search, once."""

    records: RunRecords
    key: str
    field: str
    claim: RunClaim
    figures: list[Callable[[], None]] = dataclass_field(default_factory=list)
    life: str = ""  # the job record the claim lives as long as ('' : the claim's own hash)
    unkept: list[str] = dataclass_field(default_factory=list)  # the answer Redis did not take
    # a batch item's: whether its worker is stopping (its slot_held hands the run back then)
    stopping: Callable[[], bool] | None = None

    def saved(self) -> Mapping[str, Any] | None:
        return json.loads(self.claim.answer) if self.claim.answer else None

    def save(self, answer: Mapping[str, Any]) -> None:
        """Kept if Redis takes it: if not, the search goes on (its result is still worth
        saving), and the answer is held here (the latest one only) until :meth:`keep_unkept`,
        which a run Redis unreachable ended calls once Redis answers again
        (:func:`~worker.queue.jobstore.outages.settle_outage`)."""
        data = json.dumps(answer, separators=(",", ":"))
        self.unkept[:] = [data]
        try:
            self.records.keep_answer(self.key, self.field, self.claim, data)
        except redis.RedisError as exc:
            log.warning("the model's answer could not be kept with the run claim: %s", exc)
            return
        self.unkept.clear()

    def keep_unkept(self) -> None:
        """Keep in the claim the answer :meth:`save` could not (if the run still holds it: a
        run that took it over has its own); raises Redis's error, the answer held still."""
        if self.unkept:
            self.records.keep_answer(self.key, self.field, self.claim, self.unkept[0])
            self.unkept.clear()

    def slot_held(self, waited: float, ran: float = 0.0) -> None:
        """The run holds its CPU slot after ``waited`` seconds: its deadline starts now (or, held
        again after a retrieval retry's back-off, goes on from the ``ran`` seconds it had run), so
        its claim is sent again, with its own token (:meth:`RunRecords.restart`): its lease and the
        time it counts start now too (``ran`` seconds back). Taken before the wait, a run that
        waited longer than its lease (one deadline) was taken over by a copy of its message, which
        paid for a second model call, and the wait was counted as the deadline's time spent (by the
        task's retry check and the next run's ``spent``). A short wait (under
        :data:`SLOT_WAIT_RESTARTS_CLAIM_SECONDS`) is left counted, saving a round trip per search;
        if Redis fails, the search goes on, the claim as it was. Refused (a copy took the claim over
        during the wait), the run stops: :class:`RunTakenOver`, before its model call, which the
        copy makes. A batch item whose worker began stopping meanwhile (``stopping``), with
        no answer kept, stops here too: :class:`HandedBack`, before its retrieval, so the
        hundreds of items queued for the slots at a SIGTERM run no retrieval the stop would
        throw away."""
        if self.stopping is not None and not self.claim.answer and self.stopping():
            raise HandedBack(f"{self.key} {self.field}: the worker is stopping")
        if waited < SLOT_WAIT_RESTARTS_CLAIM_SECONDS:
            return
        try:
            held = self.records.restart(
                self.key, self.field, self.claim, life=self.life or self.key, ran=ran
            )
        except redis.RedisError as exc:
            log.warning("the run claim could not be restarted once its CPU slot was held: %s", exc)
            return
        if not held:
            raise RunTakenOver(f"{self.key} {self.field}: another run took its claim over")

    def later(self, figures: Sequence[Callable[[], None]]) -> None:
        self.figures.extend(figures)

    def record(self) -> None:
        """Record the run's figures (once: they are then gone)."""
        while self.figures:
            self.figures.pop(0)()


class RunRecords(_StoreCore):
    """Run claims of searches (a field of the search's record) and of batch items (a hash per
    batch, living as long as the batch's record: it takes that key's TTL at each claim).

    The store knows which claims this process's runs hold (``_running``): a search's, an
    ingest's or a batch chunk's from its grant to its release (the task's ``finally``), a
    batch item's to its end (:meth:`ended_item`: it does not let go when it finishes). A claim
    naming this worker that none of them holds is a run gone, whose end Redis lost with its
    last writes: a redelivered copy on this worker takes it over at once (an item's start
    too) instead of waiting out its lease (an ingest's, 630 s; a chunk's, 770 s)."""

    def claim_search(self, job_id: str, owner: str, *, lease_seconds: float) -> RunClaim:
        key = SEARCH_KEY + job_id
        return self._claim(key, "run", owner, lease_seconds, life=key, held_here=True)

    def release_search(self, job_id: str, claim: RunClaim) -> None:
        self._release(SEARCH_KEY + job_id, "run", claim)

    def ended_search(self, job_id: str, claim: RunClaim) -> None:
        """The search's run holding ``claim`` has ended without letting go (Redis failed
        under it): no Redis write, the claim stays as it is in Redis, a run gone that its
        redelivery takes over, its time not counted (:meth:`ended_item`'s, for a search)."""
        self._forget(SEARCH_KEY + job_id, "run", claim.token)

    def claim_ingest(self, job_id: str, owner: str, *, lease_seconds: float) -> RunClaim:
        """An ingest-kind job's run (an upsert, a delete, a drop): the same claim, its time
        and answer unused (a field of its record, as a search's)."""
        key = INGEST_KEY + job_id
        return self._claim(key, "run", owner, lease_seconds, life=key, held_here=True)

    def release_ingest(self, job_id: str, claim: RunClaim) -> None:
        self._release(INGEST_KEY + job_id, "run", claim)

    def ended_ingest(self, job_id: str, claim: RunClaim) -> None:
        """:meth:`ended_search`'s, for an ingest-kind job's run: Redis failed under it."""
        self._forget(INGEST_KEY + job_id, "run", claim.token)

    def claim_chunk(
        self, batch_id: str, start: int, stop: int, owner: str, *, lease_seconds: float
    ) -> RunClaim:
        """A batch chunk task's run over the positions [start, stop) (a hash per batch, as
        its items' claims, living as long as the batch's record): the same claim, its time
        and answer unused. Taken before the delivery is counted, so a copy of the chunk's
        message delivered while another live run holds it is no poison: counted, the copy
        past the limit failed the items that run had not reached yet."""
        key, life = BATCH_CHUNK_RUNS_KEY + batch_id, BATCH_KEY + batch_id
        return self._claim(key, f"{start}-{stop}", owner, lease_seconds, life=life, held_here=True)

    def release_chunk(self, batch_id: str, start: int, stop: int, claim: RunClaim) -> None:
        self._release(BATCH_CHUNK_RUNS_KEY + batch_id, f"{start}-{stop}", claim)

    def held_chunks(self, batch_id: str) -> list[range]:
        """The positions of each chunk of the batch a live run holds by its claim (its
        owner's heartbeat alive, its lease not over), as :meth:`claim_chunk` would refuse it
        to another worker's copy."""
        fields = self._held_chunks(
            keys=[BATCH_CHUNK_RUNS_KEY + batch_id], args=[WORKER_HEARTBEAT_KEY]
        )
        held = []
        for field in fields:  # "<start>-<stop>"
            name = field.decode() if isinstance(field, bytes) else str(field)
            start, _, stop = name.partition("-")
            held.append(range(int(start), int(stop)))
        return held

    def claim_item(
        self, batch_id: str, query_id: str, owner: str, *, lease_seconds: float
    ) -> RunClaim:
        key, life = BATCH_RUNS_KEY + batch_id, BATCH_KEY + batch_id
        return self._claim(
            key, query_id, owner, lease_seconds, life=life, held_here=True,
            lost=BATCH_LOST_KEY + batch_id,
        )  # fmt: skip

    def release_item(
        self, batch_id: str, query_id: str, claim: RunClaim, *, counted: bool = True
    ) -> None:
        """Let the item's run claim go, adding the seconds the run ran to the deadline's time
        used; ``counted=False`` adds none: the run was handed back by its stopping worker
        before any call was billed, and the next starts it again whole (its retrieval, its
        wait for the budget), as a run taken over does. Counted, each rolling restart took
        the seconds its items had waited (their reservation, a 429's ``retry-after``) from
        their next run's deadline."""
        self._release(BATCH_RUNS_KEY + batch_id, query_id, claim, counted=counted)

    def ended_item(self, batch_id: str, query_id: str, claim: RunClaim) -> None:
        """The item's run holding ``claim`` has ended (its item finished, or it stopped):
        no Redis write, the claim stays as it is in Redis."""
        self._forget(BATCH_RUNS_KEY + batch_id, query_id, claim.token)

    def search_answers(self, job_id: str, claim: RunClaim) -> ClaimAnswers:
        """Where the run holding ``claim`` keeps its model's answer, and finds an earlier one."""
        return ClaimAnswers(self, SEARCH_KEY + job_id, "run", claim)

    def item_answers(
        self,
        batch_id: str,
        query_id: str,
        claim: RunClaim,
        stopping: Callable[[], bool] | None = None,
    ) -> ClaimAnswers:
        """The item's run claim as its keeper; ``stopping``: its worker's stop, which hands
        the run back once it holds its CPU slot (:meth:`ClaimAnswers.slot_held`)."""
        return ClaimAnswers(
            self, BATCH_RUNS_KEY + batch_id, query_id, claim, life=BATCH_KEY + batch_id,
            stopping=stopping,
        )  # fmt: skip

    def keep_answer(self, key: str, field: str, claim: RunClaim, answer: str) -> bool:
        """Keep ``answer`` in the claim, if its run still holds it; answers whether it did."""
        if not claim.granted:
            return False
        args = [field, claim.token, answer]
        (reply,) = self._transitions.call([(self._keep_answer, [key], args)])
        if isinstance(reply, Exception):
            raise reply
        return int(reply) == 1

    def restart(
        self, key: str, field: str, claim: RunClaim, *, life: str, ran: float = 0.0
    ) -> bool:
        """Send the claim of the run holding ``claim`` again, with its own token: the claim script
        answers it as that run starting now, having run ``ran`` seconds already (its claim's time
        and lease restart ``ran`` seconds back, its ``spent`` as it was), and ``claim`` takes the
        answer (``spent``, ``local_at``, ``answer``). Answers whether it was granted: refused,
        another run took the claim over meanwhile, and ``claim`` is left as it was."""
        if not claim.granted:
            return False
        with self._running_lock:
            held = ",".join(self._running.get(key + "|" + field, set()))
        granted, spent, answer, local_at, _ = self._send_claim(
            key, field, claim.owner, claim.token, claim.lease, life=life, held=held, ran=ran
        )
        if not granted:
            log.warning("the run claim %s %s was taken over by another run", key, field)
            return False
        claim.spent, claim.local_at, claim.answer = spent, local_at - ran, answer
        return True

    def _claim(
        self, key: str, field: str, owner: str, lease: float, *, life: str,
        held_here: bool = False, lost: str | None = None,
    ) -> RunClaim:  # fmt: skip
        """``life``: the job record the claim lives as long as (its TTL; gone, no claim is
        written). ``held_here``: the run lets go when it ends, so the claim is kept in
        ``_running`` until then; a claim of the job naming this worker that is not kept there
        is a run gone. ``lost``: where the job's runs lost are counted (a batch item's)."""
        token = os.urandom(8).hex()
        held = None
        if held_here:  # held from before the call: a claim sent with it sees it held
            with self._running_lock:
                tokens = self._running.setdefault(key + "|" + field, set())
                tokens.add(token)
                held = ",".join(tokens)
        try:
            granted, spent, answer, local_at, runs_lost = self._send_claim(
                key, field, owner, token, lease, life=life, held=held, lost=lost
            )
        except BaseException:
            self._forget(key, field, token)
            raise
        if not granted:
            self._forget(key, field, token)  # refused: this run holds nothing
        return RunClaim(granted=granted, spent=spent, token=token, local_at=local_at,
                        answer=answer, owner=owner, lease=lease, lost=runs_lost)  # fmt: skip

    def _send_claim(
        self, key: str, field: str, owner: str, token: str, lease: float, *, life: str,
        held: str | None, ran: float = 0.0, lost: str | None = None,
    ) -> tuple[bool, float, str, float, int]:  # fmt: skip
        """One :data:`_CLAIM_RUN` call (``held``: the tokens of this process's runs holding
        claims of that field; None: not told; ``ran``: a restart's run's seconds so far;
        ``lost``: where the job's runs lost are counted). Answers whether it was granted, the
        seconds the earlier runs spent, the answer kept, this process's clock at the reply,
        and the job's runs lost."""
        args = [field, owner, token, repr(lease), WORKER_HEARTBEAT_KEY]
        if held is not None:
            args.append(held)
        if ran:
            assert held is not None  # ARGV[7] follows ARGV[6]
            args.append(repr(ran))
        keys = [key, life] if lost is None else [key, life, lost]
        (reply,) = self._transitions.call([(self._claim_run, keys, args)])
        local_at = time.monotonic()
        if isinstance(reply, Exception):
            raise reply
        granted, spent, answer, runs_lost = reply
        text = answer.decode() if isinstance(answer, bytes) else str(answer)
        return int(granted) == 1, float(spent), text, local_at, int(runs_lost)

    def _release(self, key: str, field: str, claim: RunClaim, *, counted: bool = True) -> None:
        if not claim.granted:
            return
        args = [field, claim.token, "1" if counted else "0"]
        try:
            (reply,) = self._transitions.call([(self._release_run, [key], args)])
        finally:  # the run ends here, let go or not
            self._forget(key, field, claim.token)
        if isinstance(reply, Exception):
            raise reply

    def _forget(self, key: str, field: str, token: str) -> None:
        """No run of this process holds the claim ``token`` (any more)."""
        with self._running_lock:
            tokens = self._running.get(key + "|" + field, set())
            tokens.discard(token)
            if not tokens:
                self._running.pop(key + "|" + field, None)
