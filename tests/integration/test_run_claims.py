"""Run claims against a real redis-server (worker/queue/jobstore/runs.py): one run at a time
per search or batch item while its worker's heartbeat lives and its lease lasts, and the time
the runs ran added up across them (a released run's and a dead one's), the waits between
them not."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import pytest
import redis

from tests.services import free_port
from worker.constants import (
    BATCH_CHUNK_RUNS_KEY,
    BATCH_KEY,
    BATCH_LOST_KEY,
    BATCH_RUNS_KEY,
    INGEST_KEY,
    SEARCH_KEY,
    WORKER_HEARTBEAT_KEY,
)
from worker.contract import ErrorInfo, SearchSpec
from worker.errors import RunTakenOver
from worker.queue.jobstore import JobStore, RunClaim, settle_outage

pytestmark = pytest.mark.integration


def _alive(store: JobStore, worker: str) -> None:
    store.redis.set(WORKER_HEARTBEAT_KEY + worker, "1", px=60_000)


def test_a_live_worker_s_claim_refuses_a_second_run_until_it_lets_go(store: JobStore) -> None:
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    _alive(store, "w1")
    first = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)
    assert first.granted and first.spent == 0.0
    time.sleep(0.2)  # the first run runs
    second = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)  # the same worker too
    assert not second.granted
    store.release_item(batch.id, "q0", second)  # refused: it holds nothing to let go
    assert not store.claim_item(batch.id, "q0", "w2", lease_seconds=30).granted
    store.release_item(batch.id, "q0", first)
    time.sleep(1.5)  # a wait between runs (a retry's backoff): not counted
    third = store.claim_item(batch.id, "q0", "w2", lease_seconds=30)
    assert third.granted and 0.2 <= third.spent < 1.5, third  # the first run's time only
    assert store.redis.ttl(BATCH_RUNS_KEY + batch.id) == -1  # as its batch: none while it runs


def test_an_item_s_start_is_refused_while_another_run_holds_its_claim_as_a_claim_would_be(
    store: JobStore,
) -> None:
    """An item's start (a chunk's copy, before its claim) writes nothing while a live run
    holds the item's claim, judged as :meth:`JobStore.claim_item` would judge it: it starts
    once that run let go, or its worker is dead, or its lease is over, or it named no owner."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    _alive(store, "w1")
    assert store.start_item(batch.id, "q0")  # nothing claimed yet
    held = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)
    assert not store.start_item(batch.id, "q0")
    store.release_item(batch.id, "q0", held)
    assert store.start_item(batch.id, "q0")  # let go
    store.claim_item(batch.id, "q0", "gone", lease_seconds=30)  # no heartbeat: dead
    assert store.start_item(batch.id, "q0")
    store.claim_item(batch.id, "q0", "w1", lease_seconds=0.1)  # taking the dead run's over
    time.sleep(0.2)  # its lease is over
    assert store.start_item(batch.id, "q0")
    store.claim_item(batch.id, "q0", "", lease_seconds=30)  # no owner: excludes nothing
    assert store.start_item(batch.id, "q0")
    assert store.batch_items(batch.id, ["q0"])[0].status == "running"


def test_a_dead_worker_s_claim_or_a_spent_lease_is_taken_over_its_time_not_counted(
    store: JobStore,
) -> None:
    """A run taken over is not charged: how long it ran before its worker died is unknown,
    and charging it to the takeover (the dead-worker check, the queue behind the rest of the
    batch) spent the whole deadline of a killed worker's in-flight items. A run that let go
    (a task retry) is still counted."""
    job = store.create_search("acme", SearchSpec(index="docs", query="a"), webhook_url=None)
    _alive(store, "w0")
    ended = store.claim_search(job.id, "w0", lease_seconds=30)
    time.sleep(0.2)  # a run that ended in a task retry: its 0.2 s counted
    store.release_search(job.id, ended)
    held = store.claim_search(job.id, "gone", lease_seconds=30)  # no heartbeat: dead
    assert held.granted and 0.2 <= held.spent < 1.5, held
    time.sleep(0.5)
    _alive(store, "w1")
    taken = store.claim_search(job.id, "w1", lease_seconds=1.0)
    assert taken.granted and taken.spent == held.spent, (taken, held)  # the dead run: none
    assert not store.claim_search(job.id, "w2", lease_seconds=30).granted
    time.sleep(1.1)  # its lease of 1 s is over: the run holding it can start no model call
    late = store.claim_search(job.id, "w2", lease_seconds=30)
    assert late.granted and late.spent == held.spent, late


def test_an_item_s_runs_lost_are_counted_only_when_taken_over_from_a_dead_worker(
    store: JobStore,
) -> None:
    """A batch item's claim counts its runs lost (``lost``), by which the item fails as
    poison: one taken over from a dead worker is; one that let go (a task retry), or one past
    its lease on a live worker (slow, not lost) is not. The count lives as long as the batch,
    and a search's claim counts none (its message's deliveries judge it)."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    first = store.claim_item(batch.id, "q0", "dead-1", lease_seconds=30)
    assert first.granted and first.lost == 0
    assert store.claim_item(batch.id, "q0", "dead-2", lease_seconds=30).lost == 1
    _alive(store, "w1")
    live = store.claim_item(batch.id, "q0", "w1", lease_seconds=0.5)
    assert live.granted and live.lost == 2
    store.release_item(batch.id, "q0", live)  # let go: a retry
    _alive(store, "w2")
    slow = store.claim_item(batch.id, "q0", "w2", lease_seconds=0.5)
    assert slow.granted and slow.lost == 2
    time.sleep(0.6)  # its lease over, its worker alive
    _alive(store, "w3")
    assert store.claim_item(batch.id, "q0", "w3", lease_seconds=30).lost == 2
    lost_ttl = store.redis.ttl(BATCH_LOST_KEY + batch.id)
    assert lost_ttl == store.redis.ttl(BATCH_KEY + batch.id) == -1  # none while it runs
    job = store.create_search("acme", SearchSpec(index="docs", query="a"), webhook_url=None)
    assert store.claim_search(job.id, "dead-1", lease_seconds=30).lost == 0
    assert store.claim_search(job.id, "dead-2", lease_seconds=30).lost == 0


def test_a_claim_is_judged_by_its_holder_s_lease_not_the_claimant_s(store: JobStore) -> None:
    """Workers with different SIFT_SEARCH_DEADLINE_SECONDS judge a claim alike: a worker of
    a short deadline took over a live run well within its own (longer) one, and both made
    the model call."""
    job = store.create_search("acme", SearchSpec(index="docs", query="a"), webhook_url=None)
    _alive(store, "w1")
    assert store.claim_search(job.id, "w1", lease_seconds=30).granted
    time.sleep(0.2)  # past the claimant's lease, within the holder's
    assert not store.claim_search(job.id, "w2", lease_seconds=0.1).granted


def test_a_claim_an_older_release_wrote_without_a_lease_is_judged_alike_by_a_start_and_a_claim(
    store: JobStore,
) -> None:
    """A claim written before claims kept their lease ("<used>|<owner>|<at>|<token>") is
    judged by the claimant's lease, by an item's start as by a claim: the start took it as
    not held, and moved (or, in a canceled batch, canceled) the item under the live run."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    _alive(store, "w1")
    (now, micros) = store.redis.time()
    store.redis.hset(BATCH_RUNS_KEY + batch.id, "q0", f"0|w1|{now}.{micros:06d}|t0ken")
    assert not store.claim_item(batch.id, "q0", "w2", lease_seconds=30).granted
    assert not store.start_item(batch.id, "q0", claimant=("w2", 30.0))
    assert store.batch_items(batch.id, ["q0"])[0].status == "queued"  # nothing written
    assert store.start_item(batch.id, "q0", claimant=("w2", 0.0))  # past its lease: not held


def test_a_claim_without_an_owner_excludes_nothing_and_a_missing_search_writes_nothing(
    store: JobStore,
) -> None:
    job = store.create_search("acme", SearchSpec(index="docs", query="a"), webhook_url=None)
    first = store.claim_search(job.id, "", lease_seconds=30)
    assert first.granted and store.claim_search(job.id, "", lease_seconds=30).granted
    assert store.claim_search("srch_missing", "w1", lease_seconds=30).granted
    assert not store.redis.exists(SEARCH_KEY + "srch_missing")


def test_a_claim_sent_again_after_its_reply_was_lost_answers_as_it_ran(store: JobStore) -> None:
    """redis-py sends a script again when the connection broke with its reply out: the second
    run of a claim must not find its own claim and refuse it (the run would then make no
    model call, and the item wait for its lease to lapse)."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    _alive(store, "w1")
    args = ["q0", "w1", "t0ken", "30", WORKER_HEARTBEAT_KEY]
    keys = [BATCH_RUNS_KEY + batch.id, BATCH_KEY + batch.id]
    first = store._claim_run(keys=keys, args=args)
    again = store._claim_run(keys=keys, args=args)
    assert int(first[0]) == int(again[0]) == 1 and float(again[1]) == float(first[1]) == 0.0
    assert not store.claim_item(batch.id, "q0", "w2", lease_seconds=30).granted


def test_a_claim_sent_again_after_an_outage_starts_its_run_and_lease_at_the_answer(
    store: JobStore,
) -> None:
    """A claim whose reply was lost is answered when redis-py's resend gets through, after
    the outage (up to 30 s of retries): the run's own deadline starts there, with what the
    earlier runs used. Its record must start there too: it kept the first send's time, so
    the outage counted as the run's (its release added it; the next run got that much less)
    and its lease lapsed that much early, a second run taking the item over while the first
    was still well within its deadline. (The sleeps leave a second and more either side.)"""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    _alive(store, "w1")
    args = ["q0", "w1", "t0ken", "1.5", WORKER_HEARTBEAT_KEY]
    keys = [BATCH_RUNS_KEY + batch.id, BATCH_KEY + batch.id]
    store._claim_run(keys=keys, args=args)  # ran; its reply lost
    time.sleep(2.0)  # Redis unreachable, longer than the lease
    again = store._claim_run(keys=keys, args=args)  # the resend: the run starts now
    assert int(again[0]) == 1 and float(again[1]) == 0.0
    time.sleep(0.3)  # the run runs: 0.3 s of its 1.5 s lease
    assert not store.claim_item(batch.id, "q0", "w2", lease_seconds=1.5).granted
    claim = RunClaim(granted=True, spent=0.0, token="t0ken", local_at=0.0)
    store.release_item(batch.id, "q0", claim)
    used = store.claim_item(batch.id, "q0", "w2", lease_seconds=1.5).spent
    assert 0.3 <= used < 2.0, used  # the run's time, not the outage's


def test_a_claim_restarts_once_its_run_holds_its_cpu_slot_after_a_long_wait(
    store: JobStore,
) -> None:
    """A run's claim is taken before it waits for its CPU slot, and its deadline starts once
    it holds one (worker/core/pipeline/_search.py): told so (:meth:`ClaimAnswers.slot_held`),
    the claim is sent again with its run's token, its lease and time starting there, so a
    copy claiming past the lease from the claim (within one from the slot) is refused, and
    the time the run leaves counted starts at the slot. A short wait sends nothing."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    _alive(store, "w1")
    claim = store.claim_item(batch.id, "q0", "w1", lease_seconds=1.5)
    answers = store.item_answers(batch.id, "q0", claim)
    answers.slot_held(0.5)  # a short wait: the claim is as it was
    time.sleep(2.0)  # the wait for the slot, longer than the lease
    answers.slot_held(2.0)
    assert claim.spent == 0.0 and claim.spent_now() < 2.0, claim
    assert not store.claim_item(batch.id, "q0", "w2", lease_seconds=1.5).granted
    store.release_item(batch.id, "q0", claim)
    used = store.claim_item(batch.id, "q0", "w2", lease_seconds=1.5).spent
    assert used < 2.0, used  # the run's time from its slot, not the wait's
    assert store.redis.ttl(BATCH_RUNS_KEY + batch.id) == -1  # as its batch: none while it runs


def test_a_claim_restarted_after_a_wait_for_the_slot_again_goes_on_from_its_run_s_time(
    store: JobStore,
) -> None:
    """Held again after a retrieval retry's back-off, the run had run ``ran`` seconds: its
    claim restarts that far back, so its lease has what is left of it, and the time counted
    is the run's own, the wait left out."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    _alive(store, "w1")
    claim = store.claim_item(batch.id, "q0", "w1", lease_seconds=2.0)
    answers = store.item_answers(batch.id, "q0", claim)
    time.sleep(2.2)  # 0.5 s of its run, then the wait for the slot again, past the lease
    answers.slot_held(1.7, ran=0.5)
    assert 0.5 <= claim.spent_now() < 1.0, claim
    assert not store.claim_item(batch.id, "q0", "w2", lease_seconds=2.0).granted  # 1.5 s left
    time.sleep(1.6)  # its lease is over, counted from 0.5 s back
    assert store.claim_item(batch.id, "q0", "w2", lease_seconds=2.0).granted


def test_a_run_whose_claim_a_copy_took_over_during_its_slot_wait_is_told_so_at_the_restart(
    store: JobStore,
) -> None:
    """Past the lease from the claim, a copy of the run's message takes the claim over while
    the run waits for its CPU slot: the restart is refused, and the run is told to stop
    (:class:`RunTakenOver`), its claim as it was and the copy's untouched."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    for worker in ("w1", "w2"):
        _alive(store, worker)
    claim = store.claim_item(batch.id, "q0", "w1", lease_seconds=1.0)
    answers = store.item_answers(batch.id, "q0", claim)
    time.sleep(1.2)  # the wait for the slot, past the lease
    copy = store.claim_item(batch.id, "q0", "w2", lease_seconds=30)
    assert copy.granted
    with pytest.raises(RunTakenOver):
        answers.slot_held(1.2)
    assert (
        claim.spent == 0.0 and not store.claim_item(batch.id, "q0", "w1", lease_seconds=30).granted
    )
    store.release_item(batch.id, "q0", claim)  # not its claim: the copy's stays
    assert not store.claim_item(batch.id, "q0", "w3", lease_seconds=30).granted


def test_a_batch_s_claims_live_as_long_as_the_batch_and_a_gone_batch_s_are_not_written(
    store: JobStore,
) -> None:
    """An item's claim shares its batch's retention (as its final move does): it took a
    full ``result_ttl`` from each claim, so the hash outlived every other key of the batch
    by as long as the batch had run; and a claim for a batch whose records are gone wrote a
    hash that nothing else of the batch has."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    assert store.claim_item(batch.id, "q0", "w0", lease_seconds=30).granted
    assert store.redis.ttl(BATCH_RUNS_KEY + batch.id) == -1  # none while the batch runs
    for key in (BATCH_KEY, BATCH_RUNS_KEY):  # an older release's batch: retention from then
        store.redis.expire(key + batch.id, store.result_ttl)
    time.sleep(1.1)  # the batch has run a while: its keys have less than result_ttl left
    assert store.claim_item(batch.id, "q0", "w1", lease_seconds=30).granted
    batch_ttl = store.redis.ttl(BATCH_KEY + batch.id)  # read first: the two expire together
    runs = store.redis.ttl(BATCH_RUNS_KEY + batch.id)
    assert 0 < runs <= batch_ttl < store.result_ttl, (runs, batch_ttl)
    assert store.claim_item("bat_gone", "q0", "w1", lease_seconds=30).granted
    assert not store.redis.exists(BATCH_RUNS_KEY + "bat_gone")


def test_a_kept_answer_goes_to_the_run_taking_the_claim_over_and_past_a_let_go_run(
    store: JobStore,
) -> None:
    """The model's answer kept with a claim outlives its run's process: the run that takes
    the claim over (its worker dead) is answered it, and carries it on, past its letting go
    (a task retry: the retry is answered it); a run no longer holding the claim keeps
    nothing; the final move drops it."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    dead = store.claim_item(batch.id, "q0", "gone", lease_seconds=30)  # no heartbeat
    assert dead.granted and dead.answer == ""
    keep = store.item_answers(batch.id, "q0", dead)
    keep.save({"positions": [2, 1], "note": "a|b"})
    taken = store.claim_item(batch.id, "q0", "gone2", lease_seconds=30)
    assert taken.granted and store.item_answers(batch.id, "q0", taken).saved() == {
        "positions": [2, 1],
        "note": "a|b",
    }
    assert not store.keep_answer(BATCH_RUNS_KEY + batch.id, "q0", dead, "{}")  # not its claim
    again = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)  # carried on
    assert again.answer == taken.answer != ""
    store.release_item(batch.id, "q0", again)
    after = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)  # the retry's run
    assert after.granted and after.spent > again.spent  # its time added
    assert after.answer == taken.answer  # carried on: the retry finishes on it
    store.item_answers(batch.id, "q0", after).save({"positions": [1]})
    assert store.begin_item(batch.id, "q0").applied
    store.finish_item(batch.id, "q0", error=ErrorInfo(type="x", message="y"))
    held = store.redis.hget(BATCH_RUNS_KEY + batch.id, "q0")  # final: its answer dropped
    assert held is not None and held.endswith(f"|{after.token}|30"), held
    job = store.create_search("acme", SearchSpec(index="docs", query="a"), webhook_url=None)
    first = store.claim_search(job.id, "", lease_seconds=30)
    store.search_answers(job.id, first).save({"x": 1})
    second = store.claim_search(job.id, "", lease_seconds=30)
    assert second.answer == '{"x":1}'
    assert store.start_search(job.id)
    store.finish_search(job.id, error=ErrorInfo(type="x", message="y"))  # final: dropped
    held = store.redis.hget(SEARCH_KEY + job.id, "run")
    assert held is not None and held.endswith(f"|{second.token}|30"), held


def test_a_claim_naming_this_worker_that_none_of_its_runs_holds_is_taken_over(
    store: JobStore,
) -> None:
    """Redis back without its last writes has a finished run's claim back (the ingest's, or
    the search's, finish and release lost): its worker is alive, but none of its runs holds
    it. Its redelivered copy on that worker takes it over at once; before, it waited out the
    lease (an ingest's 630 s), refused as "another run holds it", while the job read
    ``running``. A run of this worker that holds it, or another worker's, still refuses."""
    ingest = store.create_ingest("acme", "docs", [])
    _alive(store, "w1")
    _alive(store, "w2")
    ran = store.claim_ingest(ingest.id, "w1", lease_seconds=630)
    held = store.redis.hget(INGEST_KEY + ingest.id, "run")
    assert not store.claim_ingest(ingest.id, "w1", lease_seconds=630).granted  # it runs here
    store.release_ingest(ingest.id, ran)
    store.redis.hset(INGEST_KEY + ingest.id, "run", held)  # the release lost with Redis
    assert not store.claim_ingest(ingest.id, "w2", lease_seconds=630).granted  # w1 alive
    again = store.claim_ingest(ingest.id, "w1", lease_seconds=630)
    assert again.granted and again.spent == 0.0  # the gone run's time: unknown, not counted
    assert not store.claim_ingest(ingest.id, "w1", lease_seconds=630).granted
    search = store.create_search("acme", SearchSpec(index="docs", query="a"), webhook_url=None)
    ran = store.claim_search(search.id, "w1", lease_seconds=30)
    held = store.redis.hget(SEARCH_KEY + search.id, "run")
    store.release_search(search.id, ran)
    store.redis.hset(SEARCH_KEY + search.id, "run", held)
    assert store.claim_search(search.id, "w1", lease_seconds=30).granted


def test_a_claim_sent_while_another_of_this_worker_is_granted_sees_that_run_held(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two copies of a search on one worker claim at once (their scripts in one round trip):
    the second, judged once the first's script granted it but before that run's reply came
    back, must find the first held, not a run gone (both would run: two model calls)."""
    job = store.create_search("acme", SearchSpec(index="docs", query="a"), webhook_url=None)
    _alive(store, "w1")
    call = store._transitions.call
    second: list[RunClaim] = []

    def with_a_second_claim_after_the_first(requests: Any) -> Any:
        replies = call(requests)
        if not second:
            second.append(RunClaim(False, 0.0, "", 0.0))  # (the second's own call: as is)
            second[0] = store.claim_search(job.id, "w1", lease_seconds=30)
        return replies

    monkeypatch.setattr(store._transitions, "call", with_a_second_claim_after_the_first)
    first = store.claim_search(job.id, "w1", lease_seconds=30)
    assert first.granted and not second[0].granted


def test_an_item_s_claim_naming_this_worker_that_no_run_of_its_holds_is_taken_over(
    store: JobStore,
) -> None:
    """An item's run keeps its claim when it ends (it does not let go), so Redis back
    without its last writes has a finished item ``running`` again with its claim, naming the
    live worker. The chunk's copy on that worker, where the run has ended, starts and claims
    the item at once; before, both were refused until the claim's 30 s lease was over, and
    the re-drive ran the item once the batch had been idle 120 s. A run still holding it here,
    or another live worker's claim, still refuses both."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    _alive(store, "w1")
    assert store.start_item(batch.id, "q0", claimant=("w1", 30.0))
    ran = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)
    assert not store.start_item(batch.id, "q0", claimant=("w1", 30.0))  # it runs here
    assert not store.claim_item(batch.id, "q0", "w1", lease_seconds=30).granted
    store.ended_item(batch.id, "q0", ran)  # its finish, lost with Redis's last writes
    assert not store.start_item(batch.id, "q0", claimant=("w2", 30.0))  # w1 is alive
    assert store.start_item(batch.id, "q0", claimant=("w1", 30.0))
    again = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)
    assert again.granted
    assert not store.start_item(batch.id, "q0", claimant=("w1", 30.0))


def test_a_chunk_s_claim_refuses_a_live_run_s_copy_and_is_taken_over_as_a_search_s(
    store: JobStore,
) -> None:
    """A batch chunk's run claim (its positions [start, stop)): a copy of its message is
    refused while a live run holds it (this worker's, or another's), whatever the copy's
    worker; another chunk of the batch is not. A dead worker's is taken over, as is one
    naming this worker that none of its runs holds (its release lost with Redis); one let
    go (handed back, retried) is taken at once. It lives as long as the batch."""
    specs = [(f"q{i}", SearchSpec(index="docs", query="a")) for i in range(4)]
    batch = store.create_batch("acme", "docs", specs)
    _alive(store, "w1")
    _alive(store, "w2")
    ran = store.claim_chunk(batch.id, 0, 2, "w1", lease_seconds=770)
    assert ran.granted
    assert not store.claim_chunk(batch.id, 0, 2, "w1", lease_seconds=770).granted
    assert not store.claim_chunk(batch.id, 0, 2, "w2", lease_seconds=770).granted
    assert store.claim_chunk(batch.id, 2, 4, "w2", lease_seconds=770).granted
    assert store.redis.ttl(BATCH_CHUNK_RUNS_KEY + batch.id) == -1  # none while it runs
    held = store.redis.hget(BATCH_CHUNK_RUNS_KEY + batch.id, "0-2")
    store.release_chunk(batch.id, 0, 2, ran)
    again = store.claim_chunk(batch.id, 0, 2, "w2", lease_seconds=770)  # let go: taken
    assert again.granted
    store.redis.delete(WORKER_HEARTBEAT_KEY + "w2")  # w2 dies holding it
    assert store.claim_chunk(batch.id, 0, 2, "w1", lease_seconds=770).granted
    store.redis.hset(BATCH_CHUNK_RUNS_KEY + batch.id, "0-2", held)  # w1's, its release lost
    assert not store.claim_chunk(batch.id, 0, 2, "w3", lease_seconds=770).granted  # w1 alive
    assert store.claim_chunk(batch.id, 0, 2, "w1", lease_seconds=770).granted


def test_an_answer_redis_did_not_take_is_held_and_kept_once_it_answers(store: JobStore) -> None:
    """A run's model answer whose keep met Redis unreachable is held by the run, not dropped;
    :func:`settle_outage` keeps it in the claim once Redis answers (and notes the outage), so
    the copy that takes the claim over is answered it: no second model call. Redis still down
    when the settle gives up, it stays held, and nothing is noted."""
    job = store.create_search("acme", SearchSpec(index="docs", query="a"), webhook_url=None)
    _alive(store, "w1")
    claim = store.claim_search(job.id, "w1", lease_seconds=30)
    down = JobStore(redis.Redis(port=free_port(), decode_responses=True))  # refused at once
    held = down.search_answers(job.id, claim)
    held.save({"positions": [2, 1]})  # the keep gave up: logged, the search goes on
    assert held.unkept and "positions" not in str(store.redis.hget(SEARCH_KEY + job.id, "run"))
    assert not settle_outage(down, job.id, [0], [held], seconds=0)
    assert held.unkept  # still held
    assert settle_outage(store, job.id, [0], [replace(held, records=store)])
    assert not held.unkept
    store.ended_search(job.id, claim)  # the run ends; its copy on w1 takes the claim over
    copy = store.claim_search(job.id, "w1", lease_seconds=30)
    assert copy.granted and json.loads(copy.answer) == {"positions": [2, 1]}
    assert store.count_redrive(job.id) == 0  # that re-drive was the outage's
    assert store.count_redrive(job.id) == 1
    down.close()
