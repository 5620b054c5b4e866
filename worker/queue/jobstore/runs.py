"""Run claims: which run of a search or a batch item may make its model call, and how much
of the search's one deadline its runs have used.

Why. A message can be delivered twice while its first run is still going: kombu's
visibility-timeout restore, a re-drive, a client's publish sent again. The status
compare-and-set keeps one result, but both runs started (``running`` may start again, so a
dead worker's item is taken over), and each paid for a model call. And a task retry or a
redelivery ran the search under a fresh deadline, so a search could run for several
deadlines in all.

How. Just before its search starts (after a batch item's pacing), a run claims the item:
one script (:data:`~worker.queue.jobstore.scripts._CLAIM_RUN`) that refuses while another run
holds the claim, its worker's heartbeat alive (:mod:`worker.queue.liveness`) and its lease
(one search deadline) not over, and otherwise records this run. A run that is refused makes
no model call: the run holding the claim finishes the item. The claim also adds up the time
the search's runs have run, in Redis's clock: a run's deadline is what is left of the one
deadline (:class:`~worker.core.budget.Deadline`'s ``spent``), and the task retries only
while some is left. The waits between runs (a retry's backoff, a batch chunk's retry
waiting for its other items, the queue) are not counted, as the wait before the first run
is not; nor is a run taken over (its worker died, or its lease is over): how long it ran
is unknown, and counting it until the takeover (the dead-worker check, then the redelivered
message's wait behind the rest of its batch) failed a killed worker's in-flight batch items
``deadline_exceeded`` by the hundreds, where the next worker finishes them.

A run that leaves its search unfinished (a task retry) lets its claim go, adding its time,
before it sends the retry (which another thread may take half a second later);
one that finishes it need not (the search is final: no run starts again). A worker killed
mid-run leaves its claim: its heartbeat expires within ``SIFT_WORKER_DEAD_AFTER_SECONDS``,
which is when :mod:`worker.queue.liveness` puts its messages back, and the redelivered run
takes the claim over with what the runs that ended left of the deadline. A process without
a heartbeat of its own (no liveness thread, or a prefork child, whose parent's heartbeat
outlives it: :func:`worker.queue.liveness.run_owner`) claims with no owner: its time is
counted when it lets go, nothing is excluded.

    claim = store.claim_item(batch_id, query_id, owner, lease_seconds=30.0)
    if claim.granted:
        try: run(spent=claim.spent)
        finally: store.release_item(batch_id, query_id, claim)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from worker.constants import BATCH_KEY, BATCH_RUNS_KEY, SEARCH_KEY, WORKER_HEARTBEAT_KEY
from worker.queue.jobstore.store import _StoreCore


@dataclass(frozen=True, slots=True)
class RunClaim:
    """A claim's answer: ``granted`` (this run may go on), ``spent`` (the seconds the
    search's earlier runs ran, in Redis's clock: the deadline's time they used), this run's
    ``token``, and ``local_at``, this process's monotonic clock at the claim (what
    :meth:`spent_now` adds to ``spent``)."""

    granted: bool
    spent: float
    token: str
    local_at: float

    def spent_now(self) -> float:
        """The deadline's time spent by now, earlier runs included."""
        return self.spent + time.monotonic() - self.local_at


class RunRecords(_StoreCore):
    """Run claims of searches (a field of the search's record) and of batch items (a hash per
    batch, living as long as the batch's record: it takes that key's TTL at each claim)."""

    def claim_search(self, job_id: str, owner: str, *, lease_seconds: float) -> RunClaim:
        key = SEARCH_KEY + job_id
        return self._claim(key, "run", owner, lease_seconds, life=key)

    def release_search(self, job_id: str, claim: RunClaim) -> None:
        self._release(SEARCH_KEY + job_id, "run", claim)

    def claim_item(
        self, batch_id: str, query_id: str, owner: str, *, lease_seconds: float
    ) -> RunClaim:
        return self._claim(
            BATCH_RUNS_KEY + batch_id, query_id, owner, lease_seconds, life=BATCH_KEY + batch_id
        )

    def release_item(self, batch_id: str, query_id: str, claim: RunClaim) -> None:
        self._release(BATCH_RUNS_KEY + batch_id, query_id, claim)

    def _claim(self, key: str, field: str, owner: str, lease: float, *, life: str) -> RunClaim:
        """``life``: the job record the claim lives as long as (its TTL; gone, no claim is
        written)."""
        token = os.urandom(8).hex()
        args = [field, owner, token, repr(lease), WORKER_HEARTBEAT_KEY]
        (reply,) = self._transitions.call([(self._claim_run, [key, life], args)])
        local_at = time.monotonic()
        if isinstance(reply, Exception):
            raise reply
        granted, spent = reply
        return RunClaim(
            granted=int(granted) == 1, spent=float(spent), token=token, local_at=local_at
        )

    def _release(self, key: str, field: str, claim: RunClaim) -> None:
        if not claim.granted:
            return
        (reply,) = self._transitions.call([(self._release_run, [key], [field, claim.token])])
        if isinstance(reply, Exception):
            raise reply
