"""The shared rate budget over a real redis-server: one bucket for several processes, refilled
by Redis's clock, settled on reported usage, and a search that cannot wait for it within its
deadline fails or falls back without calling the model (``budget_exhausted``).

Admissions are counted, never timed: where the refill during a test matters, the bound is
computed from Redis's own clock readings.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import pytest
import redis
from prometheus_client import REGISTRY

from tests import fake_anthropic as fa
from tests.fakes import FakeClock, FakeEmbedder, InMemoryBackend, RecordingRecorder
from tests.services import redis_server
from worker.adapters.anthropic import AnthropicReranker
from worker.adapters.anthropic_batches import AnthropicMessageBatches
from worker.adapters.rate_budget import (
    BACKLOG_REFRESH_SECONDS,
    BURST_FRACTION,
    LEARN_LEASE_SECONDS,
    OFF_REFRESH_SECONDS,
    OUTAGE_BACKLOG_SECONDS,
    OUTAGE_FIRST_SECONDS,
    OUTAGE_MAX_SECONDS,
    PENDING_SECONDS,
    PROBE_POLL_SECONDS,
    UNSTATED_SECONDS,
    BatchQueue,
    BatchQueueFull,
    MeteredBatches,
    RedisRateBudget,
    limits_from_headers,
)
from worker.contract import DocumentIn, SearchSpec
from worker.core.pipeline import WAIT_CHECK_SECONDS, SearchPipeline
from worker.core.ports import Recorder
from worker.core.types import RerankPrompt, TokenUsage
from worker.errors import (
    AttemptOutcome,
    Canceled,
    HandedBack,
    RerankAttemptError,
    RerankFailed,
)
from worker.observability.metrics import PrometheusRecorder
from worker.redis_client import QUICK_SOCKET_TIMEOUT, connect
from worker.runtime.bootstrap import build_batch_client, build_pipeline, build_rate_budget
from worker.runtime.inprocess import Runtime
from worker.runtime.ratelimit import LimitedReranker, ProviderLimiter
from worker.settings import RateLimit, Settings, load_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "claude-haiku-4-5"
PROMPT = RerankPrompt(
    policy="listwise.v1",
    system="rank them",
    user="Question: q\n" + "\n".join(f"[{i}] Title: text {i}" for i in range(1, 6)),
    output_schema={"type": "object"},
    max_tokens=100,
    candidate_count=5,
    truncated=(False,) * 5,
)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


def paused_until(client: redis.Redis, key: str) -> float:
    """The instant, on Redis's clock, until which a 429 paused the bucket at ``key``."""
    return float(client.hget(key, "pause") or 0)


def request_wait(client: redis.Redis, key: str, rpm: int) -> Callable[[float], float]:
    """What the bucket at ``key`` (limited to ``rpm``) holds now, as the wait it makes one
    more request wait at a later instant on Redis's clock (nothing taken meanwhile)."""
    level, at = (float(v or 0) for v in client.hmget(key, ["r", "at"]))
    rate, cap = rpm / 60, rpm * BURST_FRACTION

    def at_instant(now: float) -> float:
        return max(0.0, (min(1.0, cap) - min(cap, level + (now - at) * rate)) / rate)

    return at_instant


def _drain(redis_url: str, limits: dict[str, int], tries: int) -> int:
    """One process's reservations that may not wait at all; answers how many were admitted."""
    budget = RedisRateBudget(redis.Redis.from_url(redis_url), MODEL, RateLimit(**limits))
    return sum(budget.reserve(PROMPT, max_wait=0.0).admitted for _ in range(tries))


def test_several_processes_never_get_more_than_the_burst_plus_the_refill(
    client: redis.Redis, redis_url: str
) -> None:
    rpm = 60  # one request a second; the bucket holds 54
    burst = int(rpm * BURST_FRACTION)
    started = redis_now(client)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        counts = pool.starmap(_drain, [(redis_url, {"rpm": rpm}, 60)] * 4)
    elapsed = redis_now(client) - started
    admitted = sum(counts)
    assert admitted >= burst  # the whole burst is usable
    assert admitted <= burst + elapsed * rpm / 60 + 1  # never beyond it and its refill


def test_the_bucket_refills_at_the_limits_rate(client: redis.Redis) -> None:
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=60))
    while budget.reserve(PROMPT, 0.0).admitted:
        pass
    # stand for 30 s gone by: move the bucket's last refill back on Redis's clock
    key = budget.key
    client.hincrbyfloat(key, "at", -30.0)
    before = redis_now(client)
    admitted = 0
    while budget.reserve(PROMPT, 0.0).admitted:
        admitted += 1
    extra = (redis_now(client) - before) * 1.0
    assert 30 <= admitted <= 30 + extra + 1


def test_a_reservation_waits_in_line_instead_of_overdrawing(client: redis.Redis) -> None:
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=600))  # one every 0.1 s
    while budget.reserve(PROMPT, 0.0).admitted:
        pass
    sends = []  # each reservation's send time on Redis's clock: when it was made + its wait
    for _ in range(5):
        grant = budget.reserve(PROMPT, max_wait=60.0)
        assert grant.admitted and grant.wait > 0
        sends.append(float(client.hget(budget.key, "at") or 0) + grant.wait)
    spacing = [b - a for a, b in itertools.pairwise(sends)]
    assert spacing == pytest.approx([0.1] * 4, abs=1e-5)  # the limit's rate, whatever the timing
    refused = budget.reserve(PROMPT, max_wait=0.0)
    assert not refused.admitted and refused.wait > 0


def test_settling_gives_back_what_the_call_did_not_use(client: redis.Redis) -> None:
    budget = RedisRateBudget(client, MODEL, RateLimit(itpm=600_000, otpm=60_000))
    grant = budget.reserve(PROMPT, 0.0)
    assert grant.admitted and grant.input_tokens > 0 and grant.output_tokens == 100
    reserved_at = float(client.hget(budget.key, "at") or 0)
    level_in = float(client.hget(budget.key, "i") or 0)
    level_out = float(client.hget(budget.key, "o") or 0)
    assert level_in == pytest.approx(600_000 * BURST_FRACTION - grant.input_tokens)
    correction = budget.estimator.correction

    used = TokenUsage(input_tokens=grant.input_tokens // 4, output_tokens=10)
    budget.settle(grant, used)

    settled_at = float(client.hget(budget.key, "at") or 0)
    refill_in = (settled_at - reserved_at) * 600_000 / 60
    refill_out = (settled_at - reserved_at) * 60_000 / 60
    cap_in, cap_out = 600_000 * BURST_FRACTION, 60_000 * BURST_FRACTION
    expected_in = min(cap_in, level_in + refill_in + grant.input_tokens - used.input_tokens)
    expected_out = min(cap_out, level_out + refill_out + 100 - 10)
    assert float(client.hget(budget.key, "i") or 0) == pytest.approx(expected_in)
    assert float(client.hget(budget.key, "o") or 0) == pytest.approx(expected_out)
    # the estimate learned that prompts take fewer tokens than it thought
    assert budget.estimator.correction < correction


def test_a_429_pauses_every_process_sharing_the_budget(client: redis.Redis) -> None:
    one = RedisRateBudget(client, MODEL, RateLimit(rpm=6000))
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=6000))
    assert other.reserve(PROMPT, 0.0).admitted
    paused_from = redis_now(client)
    one.pause(5.0)
    asked_from = redis_now(client)
    refused = other.reserve(PROMPT, max_wait=1.0)
    asked_by = redis_now(client)
    until = paused_until(client, one.key)
    assert paused_from + 5.0 <= until <= asked_from + 5.0  # 5 s from the pause, Redis's clock
    # the other waits out what is left of it when it asks (between the two readings)
    assert not refused.admitted
    assert until - asked_by - 1e-6 <= refused.wait <= until - asked_from + 1e-6


def _half_open(client: redis.Redis, key: str) -> None:
    """The breaker's opening over, as if its seconds had passed."""
    client.hset(key, "open", f"{redis_now(client) - 0.001:.6f}")


def test_a_5xx_opens_the_breaker_for_every_process_then_one_probe_goes_alone(
    client: redis.Redis,
) -> None:
    """The provider answered 5xx (a 529: overloaded): no process sends for a second, then
    one call (the probe) goes alone; the others are refused (``shut``: ask again) until an
    answer that is not a 5xx closes the breaker. Before, every process kept sending: a 300-item
    batch sent 900 calls in 3.5 s into a 529 outage and failed every item. Both processes
    here know no limit (the budget off): the breaker turns them on."""
    one, other = RedisRateBudget(client, MODEL), RedisRateBudget(client, MODEL)
    assert other.reserve(PROMPT, 0.0).admitted  # off: at once
    one.trip(None)
    time.sleep(OFF_REFRESH_SECONDS)  # off, the other reads the shared hash this often
    refused = other.reserve(PROMPT, 30.0)
    assert not refused.admitted and refused.shut
    assert OUTAGE_FIRST_SECONDS - OFF_REFRESH_SECONDS - 0.1 <= refused.wait <= OUTAGE_FIRST_SECONDS
    assert other.backlog() == OUTAGE_BACKLOG_SECONDS  # a batch starts no new item meanwhile
    _half_open(client, one.key)
    probe = one.reserve(PROMPT, 30.0)
    assert probe.admitted and probe.wait == 0.0
    held = other.reserve(PROMPT, 30.0)
    assert not held.admitted and held.shut and 0 < held.wait <= PROBE_POLL_SECONDS
    one.settle(probe, TokenUsage(input_tokens=100, output_tokens=5))  # answered: back
    assert other.reserve(PROMPT, 30.0).admitted
    assert other.backlog() < OUTAGE_BACKLOG_SECONDS


def _items_let_start(budget: RedisRateBudget, n: int) -> list[float]:
    """What ``n`` batch items of ``budget``'s process, each on its own thread as a worker's
    item pool runs them, read pacing at once (:meth:`RedisRateBudget.backlog`); those that
    may go start (:meth:`RedisRateBudget.started`), and their threads stay for their call."""
    together = threading.Barrier(n)

    def item() -> float:
        together.wait(timeout=10)  # n threads, all asking before any ends
        reading = budget.backlog()
        if reading < OUTAGE_BACKLOG_SECONDS:
            budget.started()
        together.wait(timeout=10)
        return reading

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: item(), range(n)))


def test_a_half_open_breaker_lets_one_item_of_a_process_start_the_others_wait_for_the_probe(
    client: redis.Redis,
) -> None:
    """The breaker's opening is over and no probe is out: of ten batch items pacing in a
    process, one reads the backlog as usual and starts (the would-be probe), the others read
    a day and keep pacing. They all started, and those beside the probe waited on the
    breaker within their deadline: in an outage that outlasts the probe they ended
    ``budget_exhausted`` with no call sent. Once the probe is out they still hold; its
    failure (a 5xx, open again) holds them, and at the next half opening one starts again;
    its answer (closed) lets them all go."""
    now = [100.0]  # the process's clock: a reading is read again when it moves
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=6000), clock=lambda: now[0])
    budget.trip(None)
    _half_open(client, budget.key)
    now[0] += BACKLOG_REFRESH_SECONDS
    readings = _items_let_start(budget, 10)
    assert sum(reading < OUTAGE_BACKLOG_SECONDS for reading in readings) == 1, readings
    prober = ThreadPoolExecutor(1)  # the item let start, on a thread of its own from here
    with prober:
        probe = prober.submit(budget.reserve, PROMPT, 30.0).result()
        assert probe.admitted and probe.probe  # it went as the probe
        assert all(r == OUTAGE_BACKLOG_SECONDS for r in _items_let_start(budget, 10))
        budget.trip(None)  # the probe failed: open again
        now[0] += BACKLOG_REFRESH_SECONDS
        assert all(r == OUTAGE_BACKLOG_SECONDS for r in _items_let_start(budget, 10))
        _half_open(client, budget.key)  # over again: one more would-be probe
        now[0] += BACKLOG_REFRESH_SECONDS
        readings = _items_let_start(budget, 10)
        assert sum(reading < OUTAGE_BACKLOG_SECONDS for reading in readings) == 1, readings
        probe = prober.submit(budget.reserve, PROMPT, 30.0).result()
        assert probe.admitted and probe.probe
        prober.submit(budget.settle, probe, TokenUsage(input_tokens=100, output_tokens=5)).result()
    now[0] += BACKLOG_REFRESH_SECONDS  # answered: closed, every item goes
    assert all(r < OUTAGE_BACKLOG_SECONDS for r in _items_let_start(budget, 10))


def test_the_item_let_start_at_a_half_opening_that_ends_without_a_call_lets_the_next_start(
    client: redis.Redis,
) -> None:
    """The would-be probe's search ended without a model call (no hit to rerank, a cancel):
    the next item to ask starts in its place, not after the claim's idle time."""
    now = [100.0]
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=6000), clock=lambda: now[0])
    budget.trip(None)
    _half_open(client, budget.key)
    now[0] += BACKLOG_REFRESH_SECONDS
    with ThreadPoolExecutor(1) as item, ThreadPoolExecutor(1) as next_item:
        assert item.submit(budget.backlog).result() < OUTAGE_BACKLOG_SECONDS
        item.submit(budget.started).result()
        assert next_item.submit(budget.backlog).result() == OUTAGE_BACKLOG_SECONDS
        item.submit(budget.ended).result()  # its search ended, no call made
        assert next_item.submit(budget.backlog).result() < OUTAGE_BACKLOG_SECONDS


def test_each_5xx_in_a_row_opens_the_breaker_longer_or_for_its_retry_after(
    client: redis.Redis,
) -> None:
    budget = RedisRateBudget(client, MODEL)
    opened = []
    for _ in range(7):
        budget.trip(None)
        opened.append(budget.reserve(PROMPT, 60.0).wait)
        _half_open(client, budget.key)
    firsts = [OUTAGE_FIRST_SECONDS * 2**n for n in range(7)]
    expected = [min(s, OUTAGE_MAX_SECONDS) for s in firsts]
    assert [round(w) for w in opened] == [round(e) for e in expected], opened
    budget.trip(7.0)  # the 5xx's own retry-after
    assert 6.9 <= budget.reserve(PROMPT, 60.0).wait <= 7.0
    _half_open(client, budget.key)
    probe = budget.reserve(PROMPT, 60.0)
    assert probe.admitted
    budget.settle(probe, TokenUsage(), closes=False)  # a 429 (an outage answers some)
    budget.pause(1.0)
    probe = budget.reserve(PROMPT, 60.0)  # the next probe: the 429 let the first's lease go
    assert probe.admitted and 0.9 <= probe.wait <= 1.0  # once the pause is over
    assert budget.reserve(PROMPT, 60.0).shut  # still not closed: the others wait
    budget.settle(probe, TokenUsage(input_tokens=90, output_tokens=4))  # answered
    assert not budget.reserve(PROMPT, 60.0).shut


def test_the_calls_in_flight_failing_together_open_the_breaker_once(
    client: redis.Redis,
) -> None:
    """An outage meets a batch's calls in flight: fifty of them fail at once, from two
    processes (529s, or connections refused), while the breaker they opened is still open.
    They are one failure of the provider, not fifty in a row: the breaker opens for its first
    second, then its probe goes, and each probe that fails opens it longer (2 s, then 4 s).
    Counted each as a strike, they opened it for the 8 s cap at once, and the probes went at
    8, 16 and 24 s, not 1, 3, 7, 15 and 23 s: a stack whose fake model was stopped for 20 s
    under a 3,000-item batch failed 6 items and an interactive search that had met it."""
    one, other = RedisRateBudget(client, MODEL), RedisRateBudget(client, MODEL)
    for budget in itertools.islice(itertools.cycle((one, other)), 50):
        budget.trip(None)
    assert one.reserve(PROMPT, 60.0).wait <= OUTAGE_FIRST_SECONDS
    opened = []
    for _ in range(2):
        _half_open(client, one.key)
        probe = other.reserve(PROMPT, 60.0)
        assert probe.admitted and probe.probe
        other.trip(None)  # the probe failed
        one.trip(None)  # and so did a call sent before the breaker opened, answered late
        opened.append(round(one.reserve(PROMPT, 60.0).wait))
    assert opened == [2 * OUTAGE_FIRST_SECONDS, 4 * OUTAGE_FIRST_SECONDS], opened


def test_a_search_whose_probe_failed_lets_another_search_go_as_the_next_probe(
    client: redis.Redis,
) -> None:
    """The breaker's probe fails: the next probe is another search's, not that one's again,
    whichever asks first once the opening is over; alone, it goes after a poll's time. A
    search that met an outage and went as each probe spent its three attempts on it: with
    openings of 1, 2 and 4 s, an 8 s outage failed an item of a 100-item batch, where the
    searches waiting on the breaker spend no attempt on a provider that is down."""
    one, other = RedisRateBudget(client, MODEL), RedisRateBudget(client, MODEL)
    one.trip(None)  # the outage: a search's call answered 529
    _half_open(client, one.key)
    probe = one.reserve(PROMPT, 60.0)  # the same search, asking first, goes as the probe
    assert probe.admitted and probe.probe
    one.trip(None)  # and fails
    _half_open(client, one.key)
    again = one.reserve(PROMPT, 60.0, yields_probe=True)  # asks first again
    assert not again.admitted and again.shut
    assert 0 < again.wait <= PROBE_POLL_SECONDS
    theirs = other.reserve(PROMPT, 60.0)  # another search, waiting on the breaker
    assert theirs.admitted and theirs.probe
    other.trip(None)  # it fails too; then no other search asks for a poll's time
    client.hset(one.key, "open", f"{redis_now(client) - PROBE_POLL_SECONDS - 0.001:.6f}")
    alone = one.reserve(PROMPT, 60.0, yields_probe=True)
    assert alone.admitted and alone.probe


def test_only_the_probe_s_answer_closes_the_breaker_not_one_sent_before_it_opened(
    client: redis.Redis,
) -> None:
    """A batch's calls in flight (sent, the breaker closed) are answered 200 after an outage
    began and opened the breaker: those answers say the provider took calls before, not that
    it is back, and leave the breaker open; the probe's answer closes it. Each such answer
    closed it, and every item waiting went into the outage: a stack at the defaults, the
    fake model answering after 6 s, met a 20 s outage of 529s under a 3,000-item batch with
    440 calls answered 529 and 102 items failed after three attempts each (``http_5xx``),
    where the items waiting on the breaker send nothing (docs/queue.md). A body that is not
    a message is an answer too: the same holds for it."""
    one = RedisRateBudget(client, MODEL, RateLimit(rpm=6000))
    other = RedisRateBudget(client, MODEL)
    sent_before = [one.reserve(PROMPT, 30.0) for _ in range(2)]  # the breaker closed
    assert all(grant.admitted and not grant.probe for grant in sent_before), sent_before
    other.trip(None)  # the outage: another call answered 529
    one.settle(sent_before[0], TokenUsage(input_tokens=100, output_tokens=5))
    assert other.reserve(PROMPT, 30.0).shut
    one.answered(sent_before[1])  # 200, a body that is not a message
    assert other.reserve(PROMPT, 30.0).shut
    _half_open(client, one.key)
    probe = one.reserve(PROMPT, 30.0)
    assert probe.admitted and probe.probe
    one.settle(probe, TokenUsage(input_tokens=100, output_tokens=5))
    assert not other.reserve(PROMPT, 30.0).shut


def test_a_search_in_flight_when_an_outage_began_is_answered_after_it_within_its_deadline(
    client: redis.Redis,
) -> None:
    """An outage of 5xx with no ``retry-after`` (529s, an overloaded provider) that lasts two
    thirds of the default search deadline (20 s of 30): the first probe after its end goes
    out, with a 1 s call, within the deadline of a search that met the outage's first 5xx,
    so the searches in flight then are answered, not ``budget_exhausted``. The breaker's
    openings are read from the budget itself (1 s doubled at each 5xx in a row, capped at
    8 s). Capped at 16 s, the probes would go at 1, 3, 7, 15 and 31 s, past the deadline
    (413 of a 900-item batch failed in such a run at the defaults)."""
    budget = RedisRateBudget(client, MODEL)
    deadline = Settings.model_fields["search_deadline_seconds"].default
    outage, call = 2 / 3 * deadline, 1.0
    probes, at = [], 0.0
    while at < outage:
        budget.trip(None)  # each probe answered 5xx while the outage lasts
        at += budget.reserve(PROMPT, 60.0).wait
        probes.append(round(at, 1))
        _half_open(client, budget.key)
    assert at + call <= deadline, probes


def test_a_probe_whose_process_died_lets_another_probe_after_its_lease(
    client: redis.Redis,
) -> None:
    one, other = RedisRateBudget(client, MODEL), RedisRateBudget(client, MODEL)
    one.trip(None)
    _half_open(client, one.key)
    assert one.reserve(PROMPT, 30.0).admitted  # the probe; its process dies, no answer
    assert other.reserve(PROMPT, 30.0).shut
    client.hset(one.key, "probe", f"{redis_now(client) - 0.001:.6f}")  # its lease ran out
    assert other.reserve(PROMPT, 30.0).admitted  # the next probe


def test_limits_learned_from_headers_turn_the_budget_on() -> None:
    headers = {
        "anthropic-ratelimit-requests-limit": "60",
        "anthropic-ratelimit-input-tokens-limit": "30000",
        "anthropic-ratelimit-output-tokens-limit": "bogus",
    }
    assert limits_from_headers(headers) == RateLimit(rpm=60, itpm=30000)
    assert limits_from_headers({"request-id": "x"}) is None


@pytest.mark.parametrize("absurd", ["inf", "-inf", "1e999", "nan", "0", "-5", "0.5", ""])
def test_an_absurd_limit_header_is_ignored_and_the_others_still_learned(absurd: str) -> None:
    """A misbehaving provider (or proxy) stating an infinite limit raised OverflowError out of
    the headers' listener: the response's other, valid, limits were not learned either."""
    headers = {
        "anthropic-ratelimit-requests-limit": absurd,
        "anthropic-ratelimit-input-tokens-limit": "30000",
    }
    assert limits_from_headers(headers) == RateLimit(itpm=30000)


def test_a_budget_without_limits_admits_at_once_until_headers_teach_it(
    client: redis.Redis,
) -> None:
    budget = RedisRateBudget(client, MODEL)
    assert all(budget.reserve(PROMPT, 0.0).admitted for _ in range(100))
    assert not client.exists(budget.key)  # off: not one Redis write
    budget.learn({"anthropic-ratelimit-requests-limit": "60"})
    assert client.hget(budget.key, "Lr") == b"60"
    admitted = 0
    while budget.reserve(PROMPT, 0.0).admitted:
        admitted += 1
    assert int(60 * BURST_FRACTION) <= admitted <= int(60 * BURST_FRACTION) + 2


def test_a_call_the_budget_let_through_while_off_is_counted_as_waiting_nothing(
    client: redis.Redis,
) -> None:
    """``sift_rate_budget_wait_seconds`` counts every call the budget let through, at 0 when
    it sent it at once: a budget off (no limit known yet: every process's first calls at the
    defaults) counted none, and the rate-limit dashboard's "sent at once" read fewer calls
    than were sent, while each one's trace said ``budget_wait_seconds: 0``."""
    labels = {"model": "off-model", "lane": "economy"}
    budget = RedisRateBudget(client, "off-model", lane="economy")

    def counted() -> float:
        return REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_count", labels) or 0.0

    before = counted()
    assert budget.reserve(PROMPT, 0.0).admitted and budget.reserve_call(0.0).admitted
    budget.sent(0.0)  # the search's call went out (the economy lane's call counts itself)
    assert counted() == before + 2
    assert not client.exists(budget.key)  # still off: not one Redis write


def in_a_thread(budget: RedisRateBudget) -> Any:
    """``budget.reserve(PROMPT, 30.0)`` from another thread of its process."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(budget.reserve, PROMPT, 30.0).result()


def test_while_no_limit_is_known_one_call_learns_them_and_the_others_wait(
    client: redis.Redis,
) -> None:
    """At the defaults (no ``SIFT_RATE_LIMITS``) the first call goes alone, the learner: every
    other call, of its process or another, is refused while it is out (asked again every
    0.2 s), and every batch item's pacing reads a day. Once its answer stated the limits,
    the others are metered on them from their next reading. Every call went at once before
    any answer was had, and a deployment's first batch overran the tier."""
    now = [100.0]  # the other process's clock: it reads the hash at most every 0.2 s
    one, other = (
        RedisRateBudget(client, MODEL),
        RedisRateBudget(client, MODEL, clock=lambda: now[0]),
    )
    grant = one.reserve(PROMPT, 30.0)
    assert grant.admitted and grant.wait == 0.0  # the learner
    assert 0 < client.ttl(one.learner_key) <= LEARN_LEASE_SECONDS
    for waits in (other.reserve(PROMPT, 30.0), in_a_thread(one)):
        assert not waits.admitted and waits.shut and waits.learning, waits
        assert waits.wait == OFF_REFRESH_SECONDS
    assert other.backlog() == OUTAGE_BACKLOG_SECONDS  # no batch item starts meanwhile
    one.learn({"anthropic-ratelimit-requests-limit": "60"})
    one.settle(grant, TokenUsage(input_tokens=100, output_tokens=10))
    assert not client.exists(one.learner_key)  # its place given up
    now[0] += OFF_REFRESH_SECONDS
    assert other.backlog() == 0.0  # the bucket has room: items start again
    admitted = 0
    while other.reserve(PROMPT, 0.0).admitted:
        admitted += 1
    assert other.learned == RateLimit(rpm=60)
    assert int(60 * BURST_FRACTION) <= admitted <= int(60 * BURST_FRACTION) + 2


def test_an_answer_that_states_no_limit_lets_every_call_go_unmetered(
    client: redis.Redis,
) -> None:
    """A provider (or a proxy before it) that states no limit in its answers must not leave
    the cluster one call at a time: the learner's answer is remembered as stating none, for
    an hour, and every call of every process goes at once meanwhile, nothing metered."""
    one, other = RedisRateBudget(client, MODEL), RedisRateBudget(client, MODEL)
    grant = one.reserve(PROMPT, 30.0)
    assert grant.admitted
    one.learn({"request-id": "req_1"})  # an answer, no limit stated
    one.settle(grant, TokenUsage(input_tokens=100, output_tokens=10))
    assert client.get(one.learner_key) == b"unstated"
    assert UNSTATED_SECONDS - 5 <= client.ttl(one.learner_key) <= UNSTATED_SECONDS
    assert all(other.reserve(PROMPT, 0.0).admitted for _ in range(50))
    assert in_a_thread(one).admitted and in_a_thread(other).admitted
    assert other.backlog() == 0.0
    assert not client.exists(one.key)  # nothing metered


@pytest.mark.parametrize(
    "ended",
    [
        lambda budget, grant: budget.settle(grant, None),  # no answer: a timeout
        lambda budget, grant: budget.settle(grant, TokenUsage(), sent=False),  # never sent
        lambda budget, grant: budget.settle(grant, TokenUsage(), closes=False),  # a 429
    ],
    ids=["no-answer", "unsent", "429"],
)
def test_a_learner_that_learned_nothing_gives_its_place_to_the_next_call(
    client: redis.Redis, ended: Callable[[RedisRateBudget, Any], None]
) -> None:
    """The learner's call got no answer, was never sent, or was answered 429 (no limit
    stated): the next call learns at once, rather than after the place's lease (20 s of
    every call held)."""
    now = [100.0]
    one, other = (
        RedisRateBudget(client, MODEL),
        RedisRateBudget(client, MODEL, clock=lambda: now[0]),
    )
    assert one.backlog() == 0.0  # a batch item goes as the learner
    grant = one.reserve(PROMPT, 30.0)
    assert grant.admitted  # the place its pacing took
    assert other.reserve(PROMPT, 30.0).learning
    ended(one, grant)
    assert not client.exists(one.learner_key)
    now[0] += OFF_REFRESH_SECONDS
    assert other.reserve(PROMPT, 30.0).admitted  # the next learner
    assert client.exists(other.learner_key)


def test_a_batch_item_that_took_the_learner_s_place_and_made_no_call_gives_it_up(
    client: redis.Redis,
) -> None:
    """A batch item whose pacing took the learner's place, its search ended without a model
    call (no hit to rerank, a cancel): the next item learns at once."""
    now = [100.0]
    one, other = (
        RedisRateBudget(client, MODEL),
        RedisRateBudget(client, MODEL, clock=lambda: now[0]),
    )
    assert one.backlog() == 0.0  # it goes, as the learner
    assert other.backlog() == OUTAGE_BACKLOG_SECONDS
    one.started()
    one.ended()
    assert not client.exists(one.learner_key)
    now[0] += OFF_REFRESH_SECONDS
    assert other.backlog() == 0.0  # the next learner


def test_a_reading_of_the_learner_s_place_sent_before_its_holder_left_is_not_kept(
    client: redis.Redis,
) -> None:
    """A thread reads the shared hash (the budget off) while the learner, another thread of
    its process, is out; the learner gives its place up between the reading's send and its
    use. The reading names the thread that left: kept, that thread's next call went as the
    learner without the place, beside the learner another process took meanwhile (two out).
    Redis is real; the hook runs the holder's settlement between the pipeline's answer and
    its use."""
    now = [100.0]  # the process reads the hash again only when this moves
    one = RedisRateBudget(client, MODEL, clock=lambda: now[0])
    other = RedisRateBudget(client, MODEL)
    with ThreadPoolExecutor(1) as holder:  # the learner's thread
        grant = holder.submit(one.reserve, PROMPT, 30.0).result()
        assert grant.admitted  # the learner
        real = client.pipeline
        armed = [True]

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = real(*args, **kwargs)
            execute = pipe.execute

            def execute_then_leave() -> Any:
                answer = execute()  # names the holder: it is out
                if armed[0]:
                    armed[0] = False
                    holder.submit(one.settle, grant, None, sent=False).result()  # it leaves
                return answer

            pipe.execute = execute_then_leave
            return pipe

        now[0] += OFF_REFRESH_SECONDS
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(client, "pipeline", pipeline)
            reader = one.reserve(PROMPT, 30.0)  # this thread's reading; the place is free
        assert not armed[0]  # the hook ran: the place was given up within the reading
        taken = other.reserve(PROMPT, 30.0)  # another process, the place free: it learns
        again = holder.submit(one.reserve, PROMPT, 30.0).result()  # no new reading (clock)
    out = [grant for grant in (reader, taken, again) if grant.admitted]
    assert len(out) == 1, (reader, taken, again)  # one learner out, the place's holder
    assert client.exists(one.learner_key)  # held by the one out


def test_a_learner_whose_process_died_lets_another_learn_after_its_lease(
    client: redis.Redis,
) -> None:
    now = [100.0]
    one, other = (
        RedisRateBudget(client, MODEL),
        RedisRateBudget(client, MODEL, clock=lambda: now[0]),
    )
    assert one.reserve(PROMPT, 30.0).admitted  # and its process is killed
    assert other.reserve(PROMPT, 30.0).learning
    client.delete(one.learner_key)  # its lease ran out
    now[0] += OFF_REFRESH_SECONDS
    assert other.reserve(PROMPT, 30.0).admitted


# --- through the pipeline, with the real SDK against the fake Messages API ------------------


@pytest.fixture(scope="module")
def server() -> Iterator[fa.FakeAnthropic]:
    with fa.FakeAnthropic() as fake:
        yield fake


@pytest.fixture
def fake(server: fa.FakeAnthropic) -> Iterator[fa.FakeAnthropic]:
    server.reset()
    server.configure(rpm=None, itpm=None, otpm=None)
    yield server


def build(
    fake: fa.FakeAnthropic,
    client: redis.Redis,
    policy: str,
    limits: RateLimit | None,
    recorder: Recorder,
    *,
    deadline: float = 3.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    answered: Callable[[], None] | None = None,
    sending: Callable[[], None] | None = None,
    **more: Any,
) -> tuple[SearchPipeline, RedisRateBudget]:
    """A pipeline on the fake over the real SDK, metered by a budget on ``client``'s Redis;
    ``more``: other settings. A call times out after 2 s of real time; under a test's own
    clock (whose deadline the machine's load cannot spend) after 30, so that a loaded
    machine's slow answer is not taken for a timeout and retried. ``answered`` runs as each
    answer's headers come in (an error's too), before the budget reads them; ``sending`` as
    each request goes out (:func:`fake_sdk`)."""
    settings = load_settings(
        rerank_enabled=True,
        generation_model=f"anthropic:{MODEL}",
        rerank_failure_policy=policy,
        search_deadline_seconds=deadline,
        **{"generation_timeout_seconds": 2.0 if clock is time.monotonic else 30.0, **more},
    )
    budget = RedisRateBudget(client, MODEL, limits)

    def on_headers(headers: Mapping[str, str]) -> None:
        if answered is not None:
            answered()
        budget.learn(headers)

    pipeline = build_pipeline(
        settings,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
        reranker=AnthropicReranker(MODEL, client=fake_sdk(fake, sending), on_headers=on_headers),
        recorder=recorder,
        rate_budget=budget,
        clock=clock,
        sleep=sleep,
    )
    Runtime(pipeline).ingest(
        "docs",
        "acme",
        [DocumentIn(id=f"d{i}", title=f"n {i}", text=f"volcano ash {i}") for i in range(20)],
    )
    return pipeline, budget


def fake_sdk(
    fake: fa.FakeAnthropic, sending: Callable[[], None] | None = None
) -> anthropic.Anthropic:
    """The real SDK on the fake, not retrying; ``sending`` runs as each request goes out."""
    http = None
    if sending is not None:
        http = anthropic.DefaultHttpxClient(event_hooks={"request": [lambda _: sending()]})
    return anthropic.Anthropic(
        base_url=fake.url, api_key="sk-test", max_retries=0, http_client=http
    )


def search(pipeline: SearchPipeline) -> Any:
    return pipeline.search(
        SearchSpec(index="docs", query="volcano ash", limit=5, include_trace=True), "acme"
    )


def exhaust(budget: RedisRateBudget) -> None:
    while budget.reserve(PROMPT, 0.0).admitted:
        pass


def test_a_search_the_budget_cannot_serve_in_time_falls_back_without_a_model_call(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    recorder = RecordingRecorder()
    pipeline, budget = build(fake, client, "fail_open", RateLimit(rpm=2), recorder)
    exhaust(budget)  # the next request frees in ~30 s; the deadline is 3 s
    wait_at = request_wait(client, budget.key, rpm=2)
    asked_from = redis_now(client)
    result = search(pipeline)
    asked_by = redis_now(client)
    assert fake.requests() == []
    assert result.rerank.applied is False
    assert result.rerank.fallback_reason == "error:budget_exhausted"
    assert result.usage.requests == 0
    attempts = result.trace["attempts"]
    assert [a["outcome"] for a in attempts] == ["budget_exhausted"]  # not retried
    # the bucket's wait when the attempt asked: what it would have had to wait
    waited = attempts[0]["budget_wait_seconds"]
    assert wait_at(asked_by) - 1e-6 <= waited <= wait_at(asked_from) + 1e-6
    assert recorder.events["attempt", "budget_exhausted"] == 1
    assert recorder.events["rerank", "budget_exhausted"] == 1


def test_a_budget_exhausted_message_says_what_a_call_needs_of_the_time_left(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """The attempt is ``budget_exhausted`` when its wait leaves the call less than twice the
    answered calls' average time: the message says how long that is. It said only the wait
    and the time left, ``it takes a call again in 7.2s, past the search deadline (28.9s
    left)``, which reads as a contradiction: a stack whose fake model answered in 5 to 18 s
    failed 24 items so in a 20 s outage. Here calls took 10 s (the clock moves as each is
    sent), so a call needs 2 s; the breaker opens 29 s with 30 s left."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=6000), RecordingRecorder(), deadline=30.0,
        clock=lambda: now[0], sleep=sleep, sending=lambda: sleep(10.0),
    )  # fmt: skip
    assert search(pipeline).rerank.applied  # answered in 10 s: the calls' average
    budget.trip(29.0)
    with pytest.raises(RerankFailed) as failed:
        search(pipeline)
    said = re.search(
        r"again in ([\d.]+)s, past the search deadline \(([\d.]+)s left, of which a call needs "
        r"([\d.]+)s\)",
        str(failed.value),
    )
    assert said is not None, str(failed.value)
    wait, left, needs = (float(said.group(n)) for n in (1, 2, 3))
    assert wait < left < wait + needs, str(failed.value)


def test_under_fail_closed_it_fails_naming_the_class_and_counts_in_metrics(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    labels = {"model": MODEL, "result": "budget_exhausted", "lane": "standard"}
    before = REGISTRY.get_sample_value("sift_rerank_attempts_total", labels) or 0.0
    pipeline, budget = build(fake, client, "fail_closed", RateLimit(rpm=2), PrometheusRecorder())
    exhaust(budget)
    with pytest.raises(RerankFailed) as failed:
        search(pipeline)
    assert failed.value.reason == "budget_exhausted"
    assert fake.requests() == []
    after = REGISTRY.get_sample_value("sift_rerank_attempts_total", labels)
    assert after == before + 1


def test_a_wait_that_fits_the_deadline_is_waited_then_the_model_is_called(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """The search's clock is the test's, moved only by the search's sleeps: its deadline
    (two minutes) is not spent while it runs, and the budget's wait (seconds, on Redis's
    clock) is recorded, not slept."""
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=2), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    exhaust(budget)
    wait_at = request_wait(client, budget.key, rpm=2)
    asked_from = redis_now(client)
    result = search(pipeline)
    asked_by = redis_now(client)
    assert result.rerank.applied is True
    assert len(fake.requests()) == 1
    attempt = result.trace["attempts"][0]
    assert attempt["outcome"] == "ok"
    waited = attempt["budget_wait_seconds"]
    assert wait_at(asked_by) - 1e-6 <= waited <= wait_at(asked_from) + 1e-6
    assert clock.sleeps == [waited] and waited > 0  # waited out, then the model was called


def test_a_batch_item_s_wait_for_its_reservation_ends_when_its_worker_stops(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A batch item's check (its worker stopping, here) is asked every second of its wait
    for the budget, not only at its end: it stops there, sends nothing, and its reservation
    goes back whole (the next request waits no longer than before). Slept in one piece, the
    wait (30 s here, up to the deadline) held a stopping worker past its stop deadline."""
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=2), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    exhaust(budget)
    before = request_wait(client, budget.key, rpm=2)(redis_now(client))

    def stopping(billed: object) -> None:  # the worker's stop began during the first second
        if clock.sleeps:
            raise HandedBack("the worker is stopping")

    spec = SearchSpec(index="docs", query="volcano ash", limit=5)
    with pytest.raises(HandedBack):
        pipeline.search(spec, "acme", stopping)
    assert clock.sleeps == [WAIT_CHECK_SECONDS]
    assert fake.requests() == []
    after = request_wait(client, budget.key, rpm=2)(redis_now(client))
    assert after <= before  # given back: a reservation held would add 30 s


def test_a_batch_item_s_wait_on_the_breaker_ends_when_its_worker_stops(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """While the provider fails (a 5xx opened the breaker, for its retry-after of 20 s), a
    batch item's wait for it asks its check every second: its worker's stop, begun during
    the first second, ends the wait there, nothing sent. Slept in one piece, it held the
    stopping worker for the whole opening (up to the search's deadline)."""
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=1_000), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    budget.trip(20.0)

    def stopping(billed: object) -> None:
        if clock.sleeps:
            raise HandedBack("the worker is stopping")

    spec = SearchSpec(index="docs", query="volcano ash", limit=5)
    with pytest.raises(HandedBack):
        pipeline.search(spec, "acme", stopping)
    assert clock.sleeps == [WAIT_CHECK_SECONDS]
    assert fake.requests() == []


def test_a_batch_item_s_wait_on_a_pause_begun_meanwhile_ends_when_its_worker_stops(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A call granted with a wait that then waits out a 429's pause another process met
    meanwhile (30 s) asks its check every second of that pause too: its worker's stop ends
    it there, nothing sent, and its reservation goes back whole. Slept in one piece, the
    pause held the stopping worker up to a minute."""
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=60), RecordingRecorder(), deadline=120.0,
        clock=clock, sleep=_paused_while_waiting(client, 30.0, clock),
    )  # fmt: skip
    exhaust(budget)  # the next request frees in about a second

    def stopping(billed: object) -> None:  # the stop began in the pause's first second
        if len(clock.sleeps) >= 2:
            raise HandedBack("the worker is stopping")

    spec = SearchSpec(index="docs", query="volcano ash", limit=5)
    with pytest.raises(HandedBack):
        pipeline.search(spec, "acme", stopping)
    wait, held = clock.sleeps
    assert 0 < wait <= 1.0 + 1e-6 and held == WAIT_CHECK_SECONDS
    assert fake.requests() == []
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=60))
    client.hset(budget.key, "pause", 0)  # the pause over: what the bucket holds is left
    assert other.reserve(PROMPT, max_wait=0.0).admitted  # given back: a request is there


def test_a_cancel_during_a_429_s_retry_after_is_seen_within_a_second(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """The back-off between attempts (here a 429's ``retry-after`` of 20 s, which the retry
    honours) asks a batch item's check every second: a cancel that comes during it stops the
    search then, the retry not sent. Slept in one piece (tenacity's wait), it was seen only
    once the 20 s were over."""
    clock = FakeClock()
    pipeline, _ = build(
        fake, client, "fail_closed", RateLimit(rpm=1_000), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    fake.script([fa.status(429, retry_after=20)])

    def canceled(billed: object) -> None:  # the cancel came during the first second
        if clock.sleeps:
            raise Canceled("the batch was canceled")

    spec = SearchSpec(index="docs", query="volcano ash", limit=5)
    with pytest.raises(Canceled):
        pipeline.search(spec, "acme", canceled)
    assert clock.sleeps == [WAIT_CHECK_SECONDS]
    assert len(fake.requests()) == 1  # the 429'd one: the retry was not sent


def test_the_wait_on_the_breaker_is_counted_in_the_budget_wait_metric(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A search that waited while the breaker was open, then went as its probe: the
    metric ``sift_rate_budget_wait_seconds`` observes its whole wait, as its trace's
    ``budget_wait_seconds`` does. It observed the last reservation's wait alone (here 0,
    the probe went at once), so the dashboard's budget-wait panel missed an outage's waits."""
    clock = FakeClock()
    labels = {"model": MODEL, "lane": "standard"}
    held: list[RedisRateBudget] = []

    def sleep(seconds: float) -> None:  # the breaker's opening over once the search waited
        clock.sleep(seconds)
        _half_open(client, held[0].key)

    def observed() -> tuple[float, float]:
        return (
            REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_sum", labels) or 0.0,
            REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_count", labels) or 0.0,
        )

    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=1_000), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=sleep,
    )  # fmt: skip
    held.append(budget)
    budget.trip(None)
    total, calls = observed()
    result = search(pipeline)
    assert result.rerank.applied is True and len(fake.requests()) == 1
    waited = result.trace["attempts"][0]["budget_wait_seconds"]
    assert waited == sum(clock.sleeps) and waited > OUTAGE_FIRST_SECONDS / 2
    now_total, now_calls = observed()
    assert now_calls == calls + 1
    assert now_total - total == pytest.approx(waited)


def test_a_wait_on_the_breaker_that_spent_the_deadline_sends_nothing(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """The breaker's wait overslept (a loaded host's threads wake late) until 10 ms of the
    deadline were left, under the 50 ms an attempt needs at the least: the attempt is
    ``budget_exhausted``, nothing sent. It went as the breaker's probe with those 10 ms and
    timed out: a call that may be billed, counted as a request and an unread attempt (seen
    on the real stack: ``no answer within 0.000685662s``, a request the provider never got)."""
    clock = FakeClock()
    sent: list[float] = []
    held: list[RedisRateBudget] = []
    deadline = 120.0

    def sleep(seconds: float) -> None:  # woken late: 10 ms of the deadline left
        clock.sleep(seconds)
        clock.now = max(clock.now, started + deadline - 0.01)
        _half_open(client, held[0].key)

    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=1_000), RecordingRecorder(),
        deadline=deadline, clock=clock, sleep=sleep, sending=lambda: sent.append(clock.now),
    )  # fmt: skip
    held.append(budget)
    budget.trip(None)
    started = clock.now  # the search's deadline starts here: only sleeps move this clock
    with pytest.raises(RerankFailed) as failed:
        search(pipeline)
    assert failed.value.reason == "budget_exhausted"
    assert sent == [] and fake.requests() == []
    assert failed.value.job_usage is None or failed.value.job_usage.requests == 0


def test_a_retry_whose_checks_spent_the_deadline_sends_nothing(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A batch item's retry after a malformed answer: its cancel check (a Redis round trip on
    a loaded host) returns with 10 ms of the deadline left, and the budget grants the call at
    once. The retry is ``budget_exhausted``, nothing sent. With no wait for the budget nothing
    looked at the deadline again, and it went with those 10 ms and timed out: a request
    counted, possibly billed, never read."""
    clock = FakeClock()
    sent: list[float] = []
    deadline = 120.0
    pipeline, _ = build(
        fake, client, "fail_closed", RateLimit(rpm=1_000), RecordingRecorder(),
        deadline=deadline, clock=clock, sleep=clock.sleep, sending=lambda: sent.append(clock.now),
    )  # fmt: skip
    fake.script([fa.malformed('{"positions": [1, 2'), fa.good()])

    def slow_check(billed: object) -> None:  # the retry's, answered late: 10 ms left
        if billed is not None:
            clock.now = max(clock.now, started + deadline - 0.01)

    started = clock.now  # the search's deadline starts here
    spec = SearchSpec(index="docs", query="volcano ash", limit=5)
    failed: RerankFailed | None = None
    try:
        pipeline.search(spec, "acme", slow_check)
    except RerankFailed as exc:
        failed = exc
    assert len(sent) == 1 and len(fake.requests()) == 1  # the malformed answer's alone
    assert failed is not None and failed.reason == "budget_exhausted"
    assert failed.job_usage is not None and failed.job_usage.requests == 1
    fake.reset()  # the good answer scripted for the retry was never asked for


def test_an_attempt_timeout_set_under_the_send_s_floor_is_sent_as_set(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """``SIFT_GENERATION_TIMEOUT_SECONDS`` set to 30 ms, under the 50 ms the send's last check
    wants left of the search's deadline: the deadline has seconds left, so the call is sent
    (answered in time or timed out), never ``budget_exhausted`` unsent for a timeout the
    settings chose."""
    pipeline, _ = build(
        fake, client, "fail_open", RateLimit(rpm=1_000), RecordingRecorder(),
        deadline=10.0, generation_timeout_seconds=0.03, generation_max_requests=1,
    )  # fmt: skip
    fake.script([fa.good()])
    result = pipeline.search(SearchSpec(index="docs", query="volcano ash", limit=5), "acme")
    assert len(fake.requests()) == 1
    assert result.rerank.fallback_reason != "error:budget_exhausted", result.rerank
    fake.reset()


ANSWER_SECONDS = 0.5  # each call's own time on the test's clock: from send to answer


def _timed_search(
    fake: fa.FakeAnthropic, client: redis.Redis, first: fa.Behaviour
) -> tuple[Any, FakeClock, tuple[float, float]]:
    """One search whose first call meets ``first``, its retry answered: on a clock that moves
    by each wait the search sleeps (slept for real too: the budget's pauses and breaker are
    on Redis's clock) and by :data:`ANSWER_SECONDS` while each call is out. Answers the
    result, the clock and the budget-wait metric's (sum, count) growth."""
    clock = FakeClock()
    labels = {"model": MODEL, "lane": "standard"}

    def observed() -> tuple[float, float]:
        return (
            REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_sum", labels) or 0.0,
            REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_count", labels) or 0.0,
        )

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        time.sleep(seconds)

    def answered() -> None:
        clock.now += ANSWER_SECONDS

    pipeline, _ = build(
        fake, client, "fail_closed", RateLimit(rpm=1_000), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=sleep, answered=answered,
    )  # fmt: skip
    fake.script([first, fa.good()])
    total, calls = observed()
    result = search(pipeline)
    now_total, now_calls = observed()
    return result, clock, (now_total - total, now_calls - calls)


@pytest.mark.parametrize("outage", ["529", "refused"])
def test_a_search_whose_probe_failed_says_so_at_its_next_reservation(
    fake: fa.FakeAnthropic, client: redis.Redis, outage: str
) -> None:
    """A 529, then the retry goes as the breaker's probe and meets a 529 too (or the provider
    refuses every connection): the third attempt's reservations (each time it asks again)
    tell the budget the search's probe failed, so that another search waiting goes as the
    next probe (a search that went as each one spent its attempts on the outage); the
    reservations before the probe's do not. A refused probe, never sent, is an attempt spent
    all the same."""
    asked: list[tuple[bool, bool]] = []  # each reservation's flag; admitted as the probe

    class Budget(RedisRateBudget):
        def reserve(
            self, prompt: RerankPrompt, max_wait: float, *, yields_probe: bool = False
        ) -> Any:
            grant = super().reserve(prompt, max_wait, yields_probe=yields_probe)
            asked.append((yields_probe, bool(grant.probe)))
            return grant

    provider = fake
    if outage == "refused":
        with fa.FakeAnthropic() as provider:
            pass  # stopped: its port refuses every connection
    pipeline, budget = build(
        provider, client, "fail_open", RateLimit(rpm=1_000), RecordingRecorder(), deadline=30.0
    )
    pipeline.rate_budget = Budget(client, MODEL, budget.limits)
    fake.script([fa.status(529), fa.status(529), fa.good()])
    result = search(pipeline)
    outcomes = [a["outcome"] for a in result.trace["attempts"]]
    failing = "http_5xx" if outage == "529" else "connection"
    assert outcomes[:2] == [failing, failing] and len(outcomes) == 3, outcomes
    probes = [n for n, (_, probe) in enumerate(asked) if probe]
    assert probes, asked  # the second attempt went as the probe
    assert all(flag == (n > probes[0]) for n, (flag, _) in enumerate(asked)), asked


def test_a_search_on_its_last_attempt_lets_another_search_go_as_the_next_probe(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A connection lost once the call went out (it opens nothing), then a 529 sent while
    the breaker was still shut by no one: the third attempt is the search's last, and its
    reservations ask the budget to let another search waiting go as the next probe, as a
    search whose probe failed does (a probe that fails ends a search on its last attempt,
    where it costs one waiting with attempts left only one of them); the first two's do not.
    By use: a 3,000-item batch at the defaults, the fake model SIGKILLed for 20 s, failed
    an item 'connection' whose three attempts met the outage, the last as the probe, beside
    hundreds waiting on the breaker with attempts to spare. Alone, it still goes."""
    asked: list[tuple[int, bool]] = []  # the calls sent before each reservation, its flag

    class Budget(RedisRateBudget):
        def reserve(
            self, prompt: RerankPrompt, max_wait: float, *, yields_probe: bool = False
        ) -> Any:
            asked.append((len(fake.requests()), yields_probe))
            return super().reserve(prompt, max_wait, yields_probe=yields_probe)

    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=1_000), RecordingRecorder(), deadline=30.0
    )
    pipeline.rate_budget = Budget(client, MODEL, budget.limits)
    fake.script([fa.drop(), fa.status(529), fa.good()])
    result = search(pipeline)
    assert result.rerank.applied, result.trace["attempts"]
    outcomes = [a["outcome"] for a in result.trace["attempts"]]
    assert outcomes == ["connection", "http_5xx", "ok"], outcomes
    assert {sent for sent, _ in asked} == {0, 1, 2}, asked
    assert all(yields == (sent == 2) for sent, yields in asked), asked


def _accounted(trace: dict[str, Any]) -> float:
    """The rerank stage's seconds as its attempts tell them: each one's own time and the
    waits before it. On the test's clock, which moves only by those, they are all of it."""
    return sum(
        a["seconds"] + a["backoff_wait_seconds"] + a["budget_wait_seconds"]
        for a in trace["attempts"]
    )


def test_a_429_s_retry_after_is_in_the_trace_and_the_budget_wait_metric(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A 429 with ``retry-after: 1``, then an answer: the retry's entry tells its back-off
    (the 429's second) apart from its own time, the stage's seconds are the attempts' times
    and waits, and ``sift_rate_budget_wait_seconds`` observes the pause (every other process
    counts it there as its wait for the budget). Before, the second was in no figure: each
    attempt 0 budget wait, and the metric counted the retry as sent at once."""
    result, clock, (waited, calls) = _timed_search(fake, client, fa.status(429, retry_after=1))
    assert result.rerank.applied and len(fake.requests()) == 2
    first, retry = result.trace["attempts"]
    assert first["outcome"] == "rate_limited" and retry["outcome"] == "ok"
    assert first["seconds"] == retry["seconds"] == ANSWER_SECONDS
    assert first["backoff_wait_seconds"] == 0.0
    assert retry["backoff_wait_seconds"] == 1.0  # the 429's retry-after: longer than a back-off
    assert retry["budget_wait_seconds"] == pytest.approx(sum(clock.sleeps) - 1.0)  # the budget's
    assert result.trace["rerank_seconds"] == pytest.approx(_accounted(result.trace))
    assert calls == 2 and waited == pytest.approx(1.0 + retry["budget_wait_seconds"])


def test_a_wait_on_the_breaker_after_a_5xx_is_not_the_retry_s_own_time(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A 529 opens the breaker; the retry backs off, then waits on the breaker until its
    opening is over, and is answered at once: its ``seconds`` are its call's alone, the
    back-off and the breaker's wait beside them. Before, its ``seconds`` began before the
    breaker's wait (806 ms shown as the call's time). The retry policy's back-off after a
    5xx is no wait for the budget: the metric observes the breaker's wait alone."""
    result, clock, (waited, calls) = _timed_search(fake, client, fa.status(529))
    assert result.rerank.applied and len(fake.requests()) == 2
    first, retry = result.trace["attempts"]
    assert first["outcome"] == "http_5xx" and retry["outcome"] == "ok"
    assert retry["seconds"] == ANSWER_SECONDS
    backoff, *breaker = clock.sleeps
    assert retry["backoff_wait_seconds"] == pytest.approx(backoff)
    assert breaker and retry["budget_wait_seconds"] == pytest.approx(sum(breaker))
    assert result.trace["rerank_seconds"] == pytest.approx(_accounted(result.trace))
    assert calls == 2 and waited == pytest.approx(retry["budget_wait_seconds"])


def test_a_5xx_s_retry_after_is_the_breaker_s_wait_in_the_budget_wait_metric(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A 529 with ``retry-after: 1`` opens the breaker for that second: every other process
    waits it out at its reservation, counted as its wait for the budget, and the retry backs
    off for it (the retry-after: longer than a back-off), then goes as the probe at once. The
    metric observes that back-off, as after a 429's: it observed the reservation's wait alone
    (0 here), so the call that met the outage was counted as sent at once."""
    result, clock, (waited, calls) = _timed_search(fake, client, fa.status(529, retry_after=1))
    assert result.rerank.applied and len(fake.requests()) == 2
    first, retry = result.trace["attempts"]
    assert first["outcome"] == "http_5xx" and retry["outcome"] == "ok"
    assert retry["backoff_wait_seconds"] == 1.0  # the 529's retry-after
    assert retry["budget_wait_seconds"] == pytest.approx(sum(clock.sleeps) - 1.0)
    assert result.trace["rerank_seconds"] == pytest.approx(_accounted(result.trace))
    assert calls == 2 and waited == pytest.approx(1.0 + retry["budget_wait_seconds"])


def test_a_retry_the_budget_cannot_serve_after_a_429_shows_the_429_s_back_off(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A 429 (``retry-after: 1``), then the retry's reservation cannot be served within the
    deadline (rpm 1: the first call took the bucket's one request): its ``budget_exhausted``
    entry shows the second it backed off, as an answered retry's does, and the stage's
    seconds are the attempts' times and back-offs (nothing waited for the budget). Before,
    the entry showed 0: the back-off was taken off the run before the budget's wait, whose
    refusal then read it, and the 429's second was in the stage's seconds and no attempt."""
    clock = FakeClock()

    def sleep(seconds: float) -> None:  # slept for real too: the pause is on Redis's clock
        clock.sleep(seconds)
        time.sleep(seconds)

    pipeline, _ = build(
        fake, client, "fail_open", RateLimit(rpm=1), RecordingRecorder(),
        deadline=10.0, clock=clock, sleep=sleep,
    )  # fmt: skip
    fake.script([fa.status(429, retry_after=1), fa.good()])
    result = search(pipeline)
    assert len(fake.requests()) == 1
    first, retry = result.trace["attempts"]
    assert first["outcome"] == "rate_limited" and retry["outcome"] == "budget_exhausted"
    assert clock.sleeps == [1.0]  # the 429's second, and no wait for the budget
    assert first["backoff_wait_seconds"] == 0.0
    assert retry["backoff_wait_seconds"] == 1.0
    shown = sum(a["seconds"] + a["backoff_wait_seconds"] for a in result.trace["attempts"])
    assert result.trace["rerank_seconds"] == pytest.approx(shown)


def test_headers_of_the_provider_teach_the_budget_its_limits(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    fake.configure(rpm=120, itpm=1_000_000)
    pipeline, budget = build(fake, client, "fail_closed", None, RecordingRecorder())
    assert not budget.active
    assert search(pipeline).rerank.applied is True
    assert budget.learned == RateLimit(rpm=120, itpm=1_000_000)
    assert budget.active
    assert client.hget(budget.key, "Lr") == b"120"
    assert budget.estimator.correction == 1.0  # the first call went unmetered: nothing settled
    assert search(pipeline).rerank.applied is True
    # the second was reserved and settled on the learned limits, calibrating the estimate
    assert budget.estimator.correction != 1.0
    assert float(client.hget(budget.key, "r") or 0) < 120 * BURST_FRACTION


def test_a_429_from_the_provider_pauses_the_shared_budget(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    recorder = RecordingRecorder()
    pipeline, _ = build(fake, client, "fail_open", RateLimit(rpm=6000), recorder)
    fake.script([fa.status(429, retry_after=30)])
    searched_from = redis_now(client)
    result = search(pipeline)  # the retry would wait 30 s: past the 3 s deadline
    searched_by = redis_now(client)
    outcomes = [a["outcome"] for a in result.trace["attempts"]]
    assert outcomes[0] == "rate_limited"
    assert len(fake.requests()) == 1
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=6000))
    until = paused_until(client, other.key)
    assert searched_from + 30.0 <= until <= searched_by + 30.0  # the 429's 30 s, from then
    asked_from = redis_now(client)
    refused = other.reserve(PROMPT, max_wait=1.0)
    asked_by = redis_now(client)
    assert not refused.admitted
    assert until - asked_by - 1e-6 <= refused.wait <= until - asked_from + 1e-6


@pytest.mark.parametrize(
    ("answer", "opens"),
    [
        (fa.status(529), True),  # overloaded: the provider is failing
        (fa.status(500), True),
        (fa.status(409), False),  # a conflict (the SDK's "lock timeout"): an answer
        (fa.status(400, should_retry=True), False),  # a 4xx it says to retry: an answer
    ],
    ids=["529", "500", "409", "400-x-should-retry-true"],
)
def test_only_a_5xx_opens_the_breaker_though_a_409_is_retried_as_one(
    fake: fa.FakeAnthropic, client: redis.Redis, answer: fa.Behaviour, opens: bool
) -> None:
    """A 409 or a 4xx sent with ``x-should-retry: true`` is retried as a 5xx is (the SDK's
    own policy) and counted ``http_5xx``, but it is an answer from a provider that is up,
    refused before any token was read: it opens no breaker (another process is let through at
    once) and gives its tokens back. Both opened the breaker as a 5xx does: every process
    stopped sending for a second or more, for a conflict on one request."""
    limits = RateLimit(rpm=6000, otpm=6000)  # refills 100 output tokens a second
    pipeline, _ = build(
        fake, client, "fail_open", limits, RecordingRecorder(), generation_max_requests=1
    )
    fake.script([answer])
    result = search(pipeline)
    assert [a["outcome"] for a in result.trace["attempts"]] == ["http_5xx"]
    assert result.rerank.fallback_reason == "error:http_5xx"
    # the output tokens reserved (max_tokens, over 1,000) given back, the bucket full again;
    # a 5xx's stand (it may have been answered in part: unknown)
    full = float(client.hget(RedisRateBudget(client, MODEL, limits).key, "o") or 0)
    assert (full == pytest.approx(6000 * BURST_FRACTION)) is not opens, full
    other = RedisRateBudget(client, MODEL, limits)
    if opens:
        assert other.reserve(PROMPT, 30.0).shut
    else:
        assert other.reserve(PROMPT, 0.0).admitted


def test_a_provider_refusing_connections_opens_the_breaker_as_a_5xx_does(
    client: redis.Redis,
) -> None:
    """A connection refused (or a host not found) is the provider unreachable: no call can
    be sent, by any process, so it opens the breaker as a 5xx does, and the others wait for
    a probe within their deadlines instead of spending their attempts on refusals. The
    connection error was counted ``connection`` and gave its reservation back, opening
    nothing: a batch's items spent their three attempts in a few seconds and failed."""
    with fa.FakeAnthropic() as down:
        pass  # stopped: its port refuses every connection
    limits = RateLimit(rpm=6000)
    pipeline, _ = build(
        down, client, "fail_open", limits, RecordingRecorder(), generation_max_requests=1
    )
    result = search(pipeline)
    assert [a["outcome"] for a in result.trace["attempts"]] == ["connection"]
    assert RedisRateBudget(client, MODEL, limits).reserve(PROMPT, 30.0).shut


def test_a_connection_lost_once_the_call_was_sent_opens_no_breaker(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A connection cut in the middle of an answer is one call's trouble (a reset, a proxy),
    not the provider out of reach: the breaker stays closed."""
    limits = RateLimit(rpm=6000)
    pipeline, _ = build(
        fake, client, "fail_open", limits, RecordingRecorder(), generation_max_requests=1
    )
    fake.script([fa.cut()])
    result = search(pipeline)
    assert [a["outcome"] for a in result.trace["attempts"]] == ["connection"]
    assert RedisRateBudget(client, MODEL, limits).reserve(PROMPT, 0.0).admitted


def test_a_429_pauses_a_process_that_knows_no_limit_yet(client: redis.Redis) -> None:
    """At the defaults (no ``SIFT_RATE_LIMITS``) a process meters nothing until it learns a
    limit; one that had no answer of its own yet admitted every call at once, without asking
    Redis, so another process's 429 paused it not at all (nor did the limits the others had
    learned meter it): the cluster's pause let every fresh process's calls through."""
    one = RedisRateBudget(client, MODEL)
    now = [100.0]  # the other process's clock: it reads the hash at most every 0.2 s
    other = RedisRateBudget(client, MODEL, clock=lambda: now[0])
    assert other.reserve(PROMPT, 0.0).admitted  # nothing known: off
    assert not client.exists(other.key)  # and nothing written
    one.pause(5.0)
    assert other.reserve(PROMPT, 0.0).admitted  # read 0 s ago: not read again yet
    now[0] += OFF_REFRESH_SECONDS
    asked_from = redis_now(client)
    refused = other.reserve(PROMPT, max_wait=1.0)
    asked_by = redis_now(client)
    until = paused_until(client, one.key)
    assert not refused.admitted
    assert until - asked_by - 1e-6 <= refused.wait <= until - asked_from + 1e-6
    economy = RedisRateBudget(client, MODEL, lane="economy")
    RedisRateBudget(client, MODEL, lane="economy").pause(5.0)
    assert not economy.reserve_call(1.0).admitted
    # limits one process learned meter another from its first call
    client.flushdb()
    learner, fresh = RedisRateBudget(client, MODEL), RedisRateBudget(client, MODEL)
    learner.learn({"anthropic-ratelimit-requests-limit": "60"})
    admitted = 0
    while fresh.reserve(PROMPT, 0.0).admitted:
        admitted += 1
    assert fresh.learned == RateLimit(rpm=60)
    assert int(60 * BURST_FRACTION) <= admitted <= int(60 * BURST_FRACTION) + 2


def test_a_429_pauses_the_searches_of_a_process_that_had_no_answer_yet(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """Two worker processes at the defaults (no ``SIFT_RATE_LIMITS``) against a provider that
    states its limits in every answer, as Anthropic's does: the first one's search is answered
    429 with a 30 s ``retry-after``; the second, which has had no answer yet, must not send
    during that pause. It sent, and was answered."""
    fake.configure(rpm=6000, itpm=10_000_000)
    first, _ = build(fake, client, "fail_open", None, RecordingRecorder())
    fake.script([fa.status(429, retry_after=30)])
    assert [a["outcome"] for a in search(first).trace["attempts"]] == ["rate_limited"]
    sent = len(fake.requests())
    recorder = RecordingRecorder()
    second, budget = build(fake, client, "fail_open", None, recorder)
    result = search(second)  # its 3 s deadline ends well inside the 30 s pause
    assert len(fake.requests()) == sent  # no request during the cluster's pause
    assert [a["outcome"] for a in result.trace["attempts"]] == ["budget_exhausted"]
    assert result.rerank.fallback_reason == "error:budget_exhausted"
    assert result.usage.requests == 0
    assert budget.learned == RateLimit(rpm=6000, itpm=10_000_000)  # the first one's


def test_a_search_waiting_for_the_learner_is_sent_on_the_limits_it_learned(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """Another process's call is out learning the limits: the search waits (its attempt
    sends nothing meanwhile), and is metered and sent once that answer stored them. Its wait
    is in its trace's ``budget_wait_seconds`` and in ``sift_rate_budget_wait_seconds``, as
    every wait for the budget is."""
    labels = {"model": MODEL, "lane": "standard"}
    learner = RedisRateBudget(client, MODEL)  # another process's
    grant = learner.reserve(PROMPT, 30.0)
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # the learner's answer comes in its first wait
        if not slept:
            learner.learn({"anthropic-ratelimit-requests-limit": "6000"})
            learner.settle(grant, TokenUsage(input_tokens=100, output_tokens=10))
        slept.append(seconds)
        time.sleep(seconds)

    def observed() -> tuple[float, float]:
        return (
            REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_sum", labels) or 0.0,
            REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_count", labels) or 0.0,
        )

    pipeline, budget = build(fake, client, "fail_closed", None, RecordingRecorder(), sleep=sleep)
    total, calls = observed()
    result = search(pipeline)
    assert result.rerank.applied is True and len(fake.requests()) == 1
    assert budget.learned == RateLimit(rpm=6000)  # metered: on the limits the learner stored
    waited = result.trace["attempts"][0]["budget_wait_seconds"]
    assert slept and waited == pytest.approx(sum(slept))
    now_total, now_calls = observed()
    assert now_calls == calls + 1 and now_total - total == pytest.approx(waited)


def test_a_search_the_learner_holds_past_its_deadline_sends_nothing(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """Another process's call is out learning the limits past the search's deadline (its
    answer slow, or its process dead and its place's lease not over): the search's attempt
    is ``budget_exhausted`` at its deadline, nothing sent, its message saying why."""
    assert RedisRateBudget(client, MODEL).reserve(PROMPT, 30.0).admitted  # out, learning
    clock = FakeClock()
    pipeline, _ = build(
        fake, client, "fail_closed", None, RecordingRecorder(),
        deadline=3.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    with pytest.raises(RerankFailed) as failed:
        search(pipeline)
    assert failed.value.reason == "budget_exhausted"
    assert "learning the provider's limits" in str(failed.value)
    assert fake.requests() == []
    assert 3.0 / 2 < sum(clock.sleeps) <= 3.0  # it waited, within its deadline


def test_a_batch_item_pacing_while_another_call_learns_stops_or_is_let_go(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """While another process's call is out learning the limits, a batch item waits in its
    pacing (its search, and its deadline, not started), and stops there once its worker is
    stopping (:class:`HandedBack`), or goes on once its batch is canceled (its search's
    check cancels it), as it does waiting on the budget's queue."""
    assert RedisRateBudget(client, MODEL).reserve(PROMPT, 30.0).admitted  # out, learning
    settings = load_settings(rerank_enabled=True, generation_model=f"anthropic:{MODEL}")
    slept: list[float] = []
    pipeline = pacing_pipeline(settings, RedisRateBudget(client, MODEL), slept.append)
    with pytest.raises(HandedBack):
        pipeline.pace(stopping=lambda: len(slept) >= 2)
    assert len(slept) == 2
    pipeline.pace(canceled=lambda: len(slept) >= 3)
    assert len(slept) == 3 and fake.requests() == []


def test_a_learner_s_answer_whose_settlement_meets_redis_gone_is_shown(
    fake: fa.FakeAnthropic, gone: tuple[redis.Redis, Callable[[], None]]
) -> None:
    """Redis stops while the learner's call is out: giving its place up meets the connection
    refused, and is logged (the place's lease ends it); the search shows its answer."""
    client, stop_redis = gone
    pipeline, _ = build(fake, client, "fail_open", None, RecordingRecorder(), answered=stop_redis)
    result = search(pipeline)
    assert result.rerank.applied is True and len(fake.requests()) == 1
    with pytest.raises(redis.ConnectionError):
        client.ping()  # the premise: Redis gone


def test_an_attempt_the_process_limiter_never_sent_neither_pauses_the_cluster_nor_counts(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """Every one of the process's ``SIFT_RERANK_MAX_IN_FLIGHT`` slots stays taken (here 1, held
    by this test) for the whole search: its attempts are ``rate_limited`` but were never sent.
    Such an attempt used to pause the whole cluster's budget for a second, as a 429 from the
    provider does, and to count in ``usage.requests``; no request reached the provider."""
    recorder = RecordingRecorder()
    pipeline, _ = build(fake, client, "fail_open", RateLimit(rpm=6000), recorder)
    limiter = ProviderLimiter(max_in_flight=1)
    assert pipeline.reranker is not None
    pipeline.reranker = LimitedReranker(pipeline.reranker, limiter)
    labels = {"model": MODEL, "lane": "standard"}
    waits = REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_count", labels) or 0.0
    with limiter.slot():  # the process's only slot, taken for the whole search
        result = search(pipeline)
    assert fake.requests() == []
    # the budget-wait metric counts calls sent: these were not (it counted each)
    assert REGISTRY.get_sample_value("sift_rate_budget_wait_seconds_count", labels) == waits
    attempts = result.trace["attempts"]
    assert attempts and all(a["outcome"] == "rate_limited" for a in attempts)
    assert all(a["sent"] is False for a in attempts)
    assert result.rerank.fallback_reason == "error:rate_limited"
    assert result.usage.requests == 0
    assert recorder.events["attempt", "rate_limited"] == len(attempts)
    # nobody else waits: the shared budget was not paused
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=6000))
    assert other.reserve(PROMPT, max_wait=0.0).admitted


def test_an_attempt_the_process_limiter_never_sent_gives_its_request_back(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """The held-back attempt's reservation is given back whole: its tokens and its request,
    which the provider never saw. The tokens were given back but the request stayed taken,
    so each attempt a full limiter held back spent one of the cluster's requests a minute.
    At 6 a minute the budget holds 5.4 and refills one in 10 s: the search's attempts, every
    one held back, must leave it full, not one down per attempt."""
    pipeline, budget = build(fake, client, "fail_open", RateLimit(rpm=6), RecordingRecorder())
    limiter = ProviderLimiter(max_in_flight=1)
    assert pipeline.reranker is not None
    pipeline.reranker = LimitedReranker(pipeline.reranker, limiter)
    with limiter.slot():  # the process's only slot, taken for the whole search
        result = search(pipeline)
    attempts = result.trace["attempts"]
    assert attempts and all(a["sent"] is False for a in attempts)
    assert fake.requests() == []
    assert float(client.hget(budget.key, "r") or 0) == pytest.approx(6 * BURST_FRACTION)


def test_backlog_answers_the_wait_without_reserving(client: redis.Redis) -> None:
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=60))
    assert budget.backlog() == 0.0  # a full bucket
    exhaust(budget)
    level = client.hget(budget.key, "r")
    first = budget.backlog()
    assert 0 < first <= 1.0  # one request frees in a second at most
    assert budget.backlog() <= first and client.hget(budget.key, "r") == level


def pacing_pipeline(
    settings: Settings, budget: RedisRateBudget, sleep: Callable[[float], None]
) -> SearchPipeline:
    """A pipeline over the real reranker and ``budget``, whose waits go through ``sleep``."""
    return build_pipeline(
        settings,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
        reranker=AnthropicReranker(MODEL, api_key="sk-test"),
        rate_budget=budget,
        sleep=sleep,
    )


def test_a_batch_item_paces_itself_until_the_queue_fits_in_its_deadline(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    settings = load_settings(
        rerank_enabled=True, generation_model=f"anthropic:{MODEL}", search_deadline_seconds=3.0
    )
    now = [0.0]  # the process's clock, which the budget's backlog reading is dated by
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=60), clock=lambda: now[0])
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # stands for time going by: the bucket refills
        slept.append(seconds)
        now[0] += seconds
        client.hincrbyfloat(budget.key, "at", -seconds)

    pipeline = pacing_pipeline(settings, budget, sleep)
    exhaust(budget)
    for _ in range(5):  # a queue of 5 s, past a third of the 3 s deadline
        assert budget.reserve(PROMPT, max_wait=60.0).admitted
    assert budget.backlog() > 1.0
    pipeline.pace()
    # the queue came to fit, and the reading now counts the item let start (a call a second)
    assert slept and budget.backlog() <= 1.0 + 1.0
    assert fake.requests() == []  # pacing calls no model


def test_a_batch_item_pacing_itself_stops_when_its_worker_does(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """Once its worker is stopping, a batch item waiting for the budget's queue to shorten
    waits no more (:class:`HandedBack`) and is not counted as let start in the budget's
    readings. It waited on, and held the worker's stop up to its deadline."""
    settings = load_settings(
        rerank_enabled=True, generation_model=f"anthropic:{MODEL}", search_deadline_seconds=3.0
    )
    now = [0.0]
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=60), clock=lambda: now[0])
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # time goes by, the bucket does not refill
        slept.append(seconds)
        now[0] += seconds

    pipeline = pacing_pipeline(settings, budget, sleep)
    exhaust(budget)
    for _ in range(5):  # a queue of 5 s, past a third of the 3 s deadline
        assert budget.reserve(PROMPT, max_wait=60.0).admitted
    with pytest.raises(HandedBack):
        pipeline.pace(stopping=lambda: len(slept) >= 2)  # the stop begins in its second wait
    assert len(slept) == 2
    assert budget._pending == {}  # not let start: no process counts it in its queue
    assert fake.requests() == []


def test_the_batch_items_paced_on_one_reading_do_not_all_start(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A process answers the budget's queue length from its last reading for
    BACKLOG_REFRESH_SECONDS, and every batch item waiting to start asks again: those asking
    on one reading all started at once, however long the queue they made, which can outgrow
    their deadline (``budget_exhausted``). Each item let start counts in the reading: with
    3 s of room (a third of a 9 s deadline) at one call a second, and the next call a part
    of a second away (the bucket drained), three of ten start on the reading, not ten."""
    settings = load_settings(
        rerank_enabled=True, generation_model=f"anthropic:{MODEL}", search_deadline_seconds=9.0
    )
    now = [0.0]  # frozen: every item asks within one reading
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=60), clock=lambda: now[0])
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # an item that must wait: counted, then let go
        slept.append(seconds)
        now[0] += seconds
        budget._backlog = (0.0, now[0])

    pipeline = pacing_pipeline(settings, budget, sleep)
    exhaust(budget)  # the typical call: one request; the next frees within a second
    now[0] += BACKLOG_REFRESH_SECONDS
    assert 0.0 < budget.backlog() <= 1.0  # the reading the items ask on
    at_once = 0
    for _ in range(10):
        waits = len(slept)
        pipeline.pace()
        at_once += len(slept) == waits
        if len(slept) > waits:
            break
    assert at_once == 3, (at_once, budget._backlog)
    assert fake.requests() == []


class PacedItems:
    """``n`` batch items, each on its own thread as a worker's item pool runs them: each is
    let start on ``budget`` (:meth:`RedisRateBudget.started`), then waits to be told what to
    do next on that thread (:meth:`then`): reserve its call, or end without one."""

    def __init__(self, budget: RedisRateBudget, n: int) -> None:
        self.budget = budget
        self.orders: list[queue.Queue[Callable[[], object]]] = [queue.Queue() for _ in range(n)]
        self.done: queue.Queue[None] = queue.Queue()
        self.threads = [
            threading.Thread(target=self._item, args=(orders,), daemon=True)
            for orders in self.orders
        ]
        for thread in self.threads:
            thread.start()
        for _ in range(n):
            self.done.get(timeout=10)

    def _item(self, orders: queue.Queue[Callable[[], object]]) -> None:
        self.budget.started()
        self.done.put(None)
        try:
            action = orders.get(timeout=30)
        except queue.Empty:  # never told: an item never heard of again
            return
        action()
        self.done.put(None)

    def then(self, action: Callable[[], object]) -> None:
        for orders in self.orders:
            orders.put(action)
        for _ in self.orders:
            self.done.get(timeout=10)
        for thread in self.threads:
            thread.join(timeout=10)


def test_the_items_let_start_count_until_they_reserve_though_the_reading_is_read_again(
    client: redis.Redis,
) -> None:
    """An item let start reserves its call only after its CPU slot, its embedding and its
    retrieval (seconds, with 300 items a process queued for the slots). Counted in the
    process's reading only until that was read again from Redis, where they had reserved
    nothing yet, hundreds started on a queue they did not see: 15 of 5,000 items of a batch
    at the limit fell back ``budget_exhausted`` in its first seconds
    (``benchmarks/bench_budget.py``). At six calls a minute each item is 10 s of queue."""
    now = [0.0]
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=6), clock=lambda: now[0])
    exhaust(budget)  # the next call frees within 10 s
    now[0] += BACKLOG_REFRESH_SECONDS
    assert 0.0 < budget.backlog() <= 10.0
    items = PacedItems(budget, 3)
    now[0] += BACKLOG_REFRESH_SECONDS  # read again: none of the three reserved yet
    assert budget.backlog() > 29.0  # their 30 s, less what refilled since the drain
    items.then(lambda: budget.reserve(PROMPT, max_wait=60.0))
    now[0] += BACKLOG_REFRESH_SECONDS
    assert 29.0 < budget.backlog() < 41.0  # now in the bucket, and counted once, not twice


def test_a_process_counts_the_items_another_let_start(client: redis.Redis) -> None:
    """Every process paces on the one budget: the items one process let start, not yet
    reserved, count in every process's reading (two budgets on one Redis stand for two
    worker processes), and stop counting once they end without a call."""
    clock = [0.0]
    one = RedisRateBudget(client, MODEL, RateLimit(rpm=6), clock=lambda: clock[0])
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=6), clock=lambda: clock[0])
    exhaust(one)
    exhaust(other)  # its typical call is known too
    clock[0] += BACKLOG_REFRESH_SECONDS
    assert 0.0 < other.backlog() <= 10.0
    items = PacedItems(one, 3)
    clock[0] += BACKLOG_REFRESH_SECONDS
    one.backlog()  # one's reading tells the cluster of its items
    assert other.backlog() > 29.0
    items.then(one.ended)  # their searches needed no model call
    clock[0] += BACKLOG_REFRESH_SECONDS
    assert one.backlog() <= 10.0
    clock[0] += BACKLOG_REFRESH_SECONDS
    assert other.backlog() <= 10.0


def test_a_process_gone_quiet_stops_counting_in_the_others_readings(client: redis.Redis) -> None:
    """The items of a process that died, or stopped reading the budget, are not counted for
    long: what each process told of its items is dated, and left out past
    PENDING_STALE_SECONDS on Redis's clock."""
    clock = [0.0]
    one = RedisRateBudget(client, MODEL, RateLimit(rpm=6), clock=lambda: clock[0])
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=6), clock=lambda: clock[0])
    exhaust(one)
    exhaust(other)
    PacedItems(one, 3)  # let start, and never heard of again
    clock[0] += BACKLOG_REFRESH_SECONDS
    one.backlog()
    assert other.backlog() > 29.0
    pending_key = one.key + ":pending"
    told = client.hget(pending_key, one.process)
    assert told is not None
    seconds, stamp = told.split()
    client.hset(pending_key, one.process, b"%s %.6f" % (seconds, float(stamp) - 60.0))
    clock[0] += BACKLOG_REFRESH_SECONDS
    assert other.backlog() <= 10.0


def test_an_item_never_heard_of_again_counts_for_pending_seconds_at_most(
    client: redis.Redis,
) -> None:
    """An item whose run stopped between its start and its search (another run held the
    item) neither reserves nor ends: it stops counting PENDING_SECONDS after it started,
    the oldest first."""
    now = [0.0]
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=6), clock=lambda: now[0])
    exhaust(budget)
    PacedItems(budget, 2)
    now[0] += PENDING_SECONDS / 2
    PacedItems(budget, 1)
    now[0] += PENDING_SECONDS / 2 + BACKLOG_REFRESH_SECONDS
    assert 9.0 < budget.backlog() <= 20.0  # the last one's 10 s, and the bucket's next call
    now[0] += PENDING_SECONDS / 2
    assert budget.backlog() <= 10.0


def test_a_paced_item_whose_search_needs_no_model_call_counts_no_more_once_it_ends(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """The item a batch let start stops counting in the readings when its search ends
    without a reservation (here: reranking off for it), by ``RateBudget.ended``; an item that
    reserves stops then (the test above). Left counted, each such item held the cluster's
    batches back by a call's refill time for PENDING_SECONDS. At six calls a minute, a call
    is 10 s."""
    pipeline, budget = build(
        fake, client, "fail_open", RateLimit(rpm=6), RecordingRecorder(), deadline=90.0
    )
    exhaust(budget)  # the next call frees within 10 s: under the 30 s of room
    pipeline.pace()
    spec = SearchSpec(index="docs", query="volcano ash", limit=5, rerank=False)
    assert pipeline.search(spec, "acme").rerank.applied is False
    time.sleep(BACKLOG_REFRESH_SECONDS)  # the next reading is read from Redis
    assert budget.backlog() <= 10.0  # the bucket's next call alone
    assert fake.requests() == []


def test_a_paced_item_that_runs_no_search_counts_no_more_once_let_go(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A batch item paced, then found held by another run (its chunk a copy), runs no
    search: ``SearchPipeline.unpace`` takes it out of the readings at once."""
    pipeline, budget = build(
        fake, client, "fail_open", RateLimit(rpm=6), RecordingRecorder(), deadline=90.0
    )
    exhaust(budget)  # the next call frees within 10 s: under the 30 s of room
    pipeline.pace()
    time.sleep(BACKLOG_REFRESH_SECONDS)
    assert budget.backlog() > 10.0  # counted: its call's 10 s on top of the bucket's
    pipeline.unpace()
    time.sleep(BACKLOG_REFRESH_SECONDS)  # the next reading is read from Redis
    assert budget.backlog() <= 10.0  # the bucket's next call alone
    assert fake.requests() == []


def test_settling_many_calls_in_flight_converges_on_the_reported_ratio(
    client: redis.Redis,
) -> None:
    """Grants settled after others moved the correction (calls in flight together) still
    calibrate toward reported / estimated, instead of feeding the correction back into itself."""
    budget = RedisRateBudget(client, MODEL, RateLimit(itpm=100_000_000))
    grants = [budget.reserve(PROMPT, 0.0) for _ in range(50)]
    raw = budget.estimator.raw(PROMPT)
    for grant in grants:
        budget.settle(grant, TokenUsage(input_tokens=round(raw / 2), output_tokens=1))
    assert budget.estimator.correction == pytest.approx(0.5, abs=0.02)


def test_backlog_is_read_from_redis_at_most_every_refresh_period(client: redis.Redis) -> None:
    """A batch asks before every item: within BACKLOG_REFRESH_SECONDS of the last reading (a
    reservation is one) the process answers it without a round trip."""
    now = [100.0]
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=60), clock=lambda: now[0])
    exhaust(budget)
    calls = budget.script_calls
    first = budget.backlog()  # the refused reservation's reading, no round trip
    assert first > 0 and budget.script_calls == calls
    for _ in range(100):
        assert budget.backlog() == first
    assert budget.script_calls == calls
    now[0] += BACKLOG_REFRESH_SECONDS
    client.hincrbyfloat(budget.key, "at", -30.0)  # half a minute went by: the bucket refilled
    assert budget.backlog() == 0.0 and budget.script_calls == calls + 1


# --- what the provider's headers teach ------------------------------------------------------


def test_a_learned_limit_below_the_configured_one_holds(client: redis.Redis) -> None:
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=6000))
    budget.learn({"anthropic-ratelimit-requests-limit": "60"})
    admitted = 0
    while budget.reserve(PROMPT, 0.0).admitted:
        admitted += 1
    assert int(60 * BURST_FRACTION) <= admitted <= int(60 * BURST_FRACTION) + 2
    higher = RedisRateBudget(client, "other-model", RateLimit(rpm=60))
    higher.learn({"anthropic-ratelimit-requests-limit": "6000"})  # never above the setting
    admitted = 0
    while higher.reserve(PROMPT, 0.0).admitted:
        admitted += 1
    assert admitted <= int(60 * BURST_FRACTION) + 2


def _settled_with(budget: RedisRateBudget, headers: dict[str, str]) -> None:
    grant = budget.reserve(PROMPT, 0.0)
    assert grant.admitted
    budget.learn(headers)  # as the model adapter calls it, before the pipeline settles
    budget.settle(grant, TokenUsage(input_tokens=grant.input_tokens, output_tokens=1))


def test_remaining_lowers_the_bucket_in_the_settlements_own_round_trip(
    client: redis.Redis,
) -> None:
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=600))  # the bucket holds 540
    budget.learn({"anthropic-ratelimit-requests-limit": "600"})
    calls = budget.script_calls
    _settled_with(budget, {"anthropic-ratelimit-requests-remaining": "100"})
    assert budget.script_calls == calls + 2  # the reservation and the settlement, no more
    level = float(client.hget(budget.key, "r") or 0)
    # the provider's 100, less its spare tenth (60), plus the refill since the call was sent
    assert 40.0 - 1e-6 <= level <= 40.0 + 10.0
    admitted = 0
    while budget.reserve(PROMPT, 0.0).admitted:
        admitted += 1
    assert admitted <= 50  # not the 539 Sift believed it had


def test_remaining_never_raises_the_bucket(client: redis.Redis) -> None:
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=600))
    exhaust(budget)
    before = float(client.hget(budget.key, "r") or 0)
    grant = budget.reserve(PROMPT, 60.0)  # one more, queued
    budget.learn({"anthropic-ratelimit-requests-remaining": "600"})  # the provider's is full
    budget.settle(grant, TokenUsage(input_tokens=grant.input_tokens, output_tokens=1))
    after = float(client.hget(budget.key, "r") or 0)
    assert after < before  # the queued request stays taken: the stated 600 gave nothing back


def test_reset_stands_in_for_a_missing_remaining(client: redis.Redis) -> None:
    from datetime import UTC, datetime, timedelta

    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=600))
    full_in_50s = (datetime.now(UTC) + timedelta(seconds=50)).strftime("%Y-%m-%dT%H:%M:%SZ")
    headers = {
        "anthropic-ratelimit-requests-limit": "600",
        "anthropic-ratelimit-requests-reset": full_in_50s,
    }
    _settled_with(budget, headers)
    level = float(client.hget(budget.key, "r") or 0)
    # full in ~50 s at 10 a second: the provider holds ~100 of 600; Sift then ~40 of 540
    assert level <= 40.0 + 20.0


def test_a_foreign_client_draining_the_provider_slows_sift_at_once(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """Another client of the organisation empties the provider's bucket. Sift's bucket is
    full; the first call's headers (a 429's, here) say the provider's holds nothing, and
    Sift stops sending rather than meeting 429 after 429."""
    fake.configure(rpm=30)
    sdk = anthropic.Anthropic(base_url=fake.url, api_key="sk-test", max_retries=0)
    for _ in range(30):  # the foreign client, on no budget
        sdk.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}])
    pipeline, budget = build(fake, client, "fail_open", RateLimit(rpm=30), PrometheusRecorder())
    result = search(pipeline)
    attempts = len(result.trace["attempts"])
    assert attempts <= 3
    # Sift's own count alone: 27 less one per attempt; the headers said the provider's is
    # empty, less its spare tenth (3): Sift's bucket is below one request
    assert float(client.hget(budget.key, "r") or 27) < 1.0
    assert not budget.reserve(PROMPT, 0.0).admitted


# --- the economy lane's own bucket ----------------------------------------------------------


def test_economy_limits_are_a_bucket_of_their_own(client: redis.Redis, redis_url: str) -> None:
    settings = load_settings(
        generation_model=f"anthropic:{MODEL}",
        redis_url=redis_url,
        rate_limits={MODEL: {"rpm": 60, "economy": {"rpm": 6}}},
    )
    standard, economy = build_rate_budget(settings), build_rate_budget(settings, "economy")
    assert standard is not None and economy is not None
    assert standard.key != economy.key and economy.lane == "economy"
    assert economy.limits == RateLimit(rpm=6)
    exhaust(standard)
    admitted = 0
    while economy.reserve_call(0.0).admitted:
        admitted += 1
    assert admitted == int(6 * BURST_FRACTION)  # the standard lane's exhaustion took none
    assert not standard.reserve(PROMPT, 0.0).admitted  # nor did the economy lane give any


def test_economy_calls_wait_for_their_bucket_and_never_touch_the_standard_one(
    fake: fa.FakeAnthropic, client: redis.Redis, redis_url: str
) -> None:
    settings = load_settings(
        generation_model=f"anthropic:{MODEL}",
        redis_url=redis_url,
        rate_limits={MODEL: {"economy": {"rpm": 6}}},  # the bucket holds 5
    )
    batches = build_batch_client(settings)
    assert isinstance(batches, MeteredBatches)
    sdk = anthropic.Anthropic(base_url=fake.url, api_key="sk-test", max_retries=0)
    batches.reranker._client, batches.reranker._owns_client = sdk, False
    batches.max_wait = 0.0
    slept: list[float] = []
    batches._sleep = slept.append
    request = {"custom_id": "i0", "params": batches.request_params(PROMPT)}
    created = batches.create([request])
    for _ in range(4):
        batches.retrieve(created.id)
    wait_at = request_wait(client, batches.budget.key, rpm=6)  # taken nothing since: refused
    asked_from = redis_now(client)
    with pytest.raises(RerankAttemptError) as refused:
        batches.retrieve(created.id)  # the sixth call in a second: not sent
    asked_by = redis_now(client)
    assert refused.value.outcome is AttemptOutcome.RATE_LIMITED
    assert "economy lane's rate budget" in refused.value.message  # refused before sending
    retry_after = refused.value.retry_after
    assert retry_after is not None  # the bucket's wait when it asked
    assert wait_at(asked_by) - 1e-6 <= retry_after <= wait_at(asked_from) + 1e-6
    assert len(fake.batches()) == 1
    assert not client.exists(f"sift:rate-budget:standard:{MODEL}")
    assert slept == []
    batches.max_wait = 60.0  # willing to wait: it sleeps for its share, then sends
    asked_from = redis_now(client)
    batches.retrieve(created.id)
    asked_by = redis_now(client)
    [waited] = slept
    assert wait_at(asked_by) - 1e-6 <= waited <= wait_at(asked_from) + 1e-6


def test_without_a_budget_the_economy_client_is_the_plain_one(redis_url: str) -> None:
    settings = load_settings(generation_model=f"anthropic:{MODEL}", redis_url=redis_url)
    off = settings.model_copy(update={"rate_budget_enabled": False})
    assert type(build_batch_client(off)) is AnthropicMessageBatches
    assert isinstance(build_batch_client(settings), MeteredBatches)


def test_a_429_from_the_batch_endpoints_pauses_the_economy_lane_alone(
    client: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_settings(generation_model=f"anthropic:{MODEL}", redis_url=redis_url)
    batches = build_batch_client(settings)
    assert isinstance(batches, MeteredBatches)

    def answered_429(self: AnthropicMessageBatches, batch_id: str) -> Any:
        raise RerankAttemptError(AttemptOutcome.RATE_LIMITED, "HTTP 429", retry_after=20.0)

    monkeypatch.setattr(AnthropicMessageBatches, "retrieve", answered_429)
    counted = REGISTRY.get_sample_value(
        "sift_provider_429_total", {"model": MODEL, "lane": "economy"}
    )
    with pytest.raises(RerankAttemptError):
        batches.retrieve("msgbatch_x")
    after = REGISTRY.get_sample_value(
        "sift_provider_429_total", {"model": MODEL, "lane": "economy"}
    )
    assert after == (counted or 0) + 1
    until = paused_until(client, batches.budget.key)
    asked_from = redis_now(client)
    refused = batches.budget.reserve_call(1.0)  # every process's economy calls wait it out
    asked_by = redis_now(client)
    assert not refused.admitted
    assert until - asked_by - 1e-6 <= refused.wait <= until - asked_from + 1e-6
    assert not client.exists(f"sift:rate-budget:standard:{MODEL}")  # searches go on


# --- the economy lane's share of the provider's processing queue ----------------------------


def _take(redis_url: str, cap: int, want: int, tries: int) -> int:
    queue = BatchQueue(redis.Redis.from_url(redis_url), MODEL, cap)
    return sum(want for _ in range(tries) if queue.take(want) is not None)


def test_several_processes_never_queue_more_than_the_cap(
    client: redis.Redis, redis_url: str
) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        taken = pool.starmap(_take, [(redis_url, 100, 7, 10)] * 4)
    assert sum(taken) == 98  # 14 submissions of 7 fit under 100; the 15th never did
    assert BatchQueue(client, MODEL, 100).queued() == 98


def _metered_batches(fake: fa.FakeAnthropic, redis_url: str, queued: int) -> MeteredBatches:
    """The economy lane's Message Batches client, metered on a processing queue of
    ``queued`` requests, sending to ``fake`` over the real SDK."""
    settings = load_settings(
        generation_model=f"anthropic:{MODEL}",
        redis_url=redis_url,
        rate_limits={MODEL: {"economy": {"queued": queued}}},
    )
    batches = build_batch_client(settings)
    assert isinstance(batches, MeteredBatches)
    sdk = anthropic.Anthropic(base_url=fake.url, api_key="sk-test", max_retries=0)
    batches.reranker._client, batches.reranker._owns_client = sdk, False
    return batches


def test_a_submission_waits_for_room_in_the_processing_queue(
    fake: fa.FakeAnthropic, client: redis.Redis, redis_url: str
) -> None:
    batches = _metered_batches(fake, redis_url, queued=8)
    assert batches.queue is not None
    params = batches.request_params(PROMPT)

    def requests(n: int) -> list[dict[str, Any]]:
        return [{"custom_id": f"i{i}", "params": params} for i in range(n)]

    first = batches.create(requests(6))
    assert batches.queue.queued() == 6
    with pytest.raises(BatchQueueFull) as full:
        batches.create(requests(6))  # 12 would be queued: not sent
    assert full.value.retryable and full.value.retry_after
    assert len(fake.batches()) == 1 and batches.queue.queued() == 6
    with pytest.raises(RerankAttemptError):
        batches.create([{"custom_id": "bad id!", "params": params}])  # refused by the provider
    assert batches.queue.queued() == 6  # its places were given back
    assert batches.retrieve(first.id).ended  # the fake processes at once
    assert batches.queue.queued() == 0  # the ended batch left the queue
    second = batches.create(requests(6))
    assert len(fake.batches()) == 2
    assert client.hkeys(batches.queue.key) == [second.id.encode()]


def test_a_probe_that_got_no_answer_lets_the_next_probe_go_at_once(client: redis.Redis) -> None:
    """A probe whose connection was dropped, or that timed out, said nothing of the
    provider: the next call probes now. Its lease (20 s) held every process back, past a
    search's deadline."""
    one, other = RedisRateBudget(client, MODEL), RedisRateBudget(client, MODEL)
    one.trip(None)
    _half_open(client, one.key)
    probe = one.reserve(PROMPT, 30.0)
    assert probe.admitted  # the probe
    assert other.reserve(PROMPT, 30.0).shut
    one.unanswered(probe)
    assert other.reserve(PROMPT, 30.0).admitted  # the next probe


@pytest.mark.parametrize(
    ("rpm", "stop"),
    [
        (2, HandedBack("the worker is stopping")),  # in its wait (about 6 s), checked each second
        (120, Canceled("the batch was canceled")),  # once its wait (half a second) is over
    ],
    ids=["handed-back-while-waiting", "canceled-after-the-wait"],
)
def test_a_probe_given_back_unsent_lets_the_next_probe_go_at_once(
    fake: fa.FakeAnthropic, client: redis.Redis, rpm: int, stop: Exception
) -> None:
    """A batch item admitted as the breaker's probe with a wait (the bucket is empty) is
    canceled, or its worker stops, before it is sent: its reservation goes back whole, and
    the probe with it, so the next call anywhere probes now. Given back as a 429's would be,
    its lease (20 s) stood: every process asked again each second and sent nothing, an outage
    over or not, past a search's deadline."""
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=rpm), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    exhaust(budget)
    budget.trip(None)
    _half_open(client, budget.key)

    def check(billed: object) -> None:  # the stop or the cancel came during its wait
        if clock.sleeps:
            raise stop

    spec = SearchSpec(index="docs", query="volcano ash", limit=5)
    with pytest.raises(type(stop)):
        pipeline.search(spec, "acme", check)
    assert clock.sleeps and fake.requests() == []  # it waited, as the probe, and sent nothing
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=rpm))
    following = other.reserve(PROMPT, 60.0)
    assert following.admitted and following.probe  # the next probe, not held 20 s


@pytest.mark.parametrize("gone", ["given back unsent", "unanswered"])
def test_a_probe_that_ends_ends_its_own_probe_not_the_next_one(
    client: redis.Redis, gone: str
) -> None:
    """A 429 ends the breaker's probe (the next goes once its pause is over) while that
    probe's call still holds its grant; another process's call is then admitted as the next
    probe. The first call, looking at the breaker at the end of a wait, is held back, and
    given back unsent (its item canceled, its worker stopping) or getting no answer, ends
    its own probe only: the second stays the one probe out, and a third call is held back.
    Before, the first was sent beside the second, and its end ended whichever probe was out:
    two probes were out at once."""
    one, other, third = (RedisRateBudget(client, MODEL, RateLimit(rpm=6000)) for _ in range(3))
    one.trip(None)
    _half_open(client, one.key)
    first = one.reserve(PROMPT, 30.0)
    assert first.admitted and first.probe
    other.pause(0.01)  # a 429 (met by any call): the probe ends, the next goes after it
    second = other.reserve(PROMPT, 30.0)
    assert second.admitted and second.probe  # the next probe
    # the first, granted with a wait, looks before it is sent: held back, the second goes
    assert one.breaker_shut(first) and not other.breaker_shut(second)
    if gone == "unanswered":
        one.unanswered(first)
    else:
        one.settle(first, TokenUsage(), sent=False, closes=False)
    held = third.reserve(PROMPT, 30.0)
    assert not held.admitted and held.shut  # the second probe is still the one out


def test_learned_limits_are_stored_again_after_the_shared_hash_is_gone(
    client: redis.Redis,
) -> None:
    """The hash expires after a day without a call, or Redis restarts empty: the limits a
    process learned are stored again by its next reservation (where the hash holds none)
    and by every settlement of an answer that states them. Before, a process stored them
    only when its own copy changed: every call after went out unmetered, for good."""
    budget = RedisRateBudget(client, MODEL)
    budget.learn({"anthropic-ratelimit-requests-limit": "60"})
    client.delete(budget.key)
    admitted = 0
    while budget.reserve(PROMPT, 0.0).admitted and admitted < 200:
        admitted += 1
    assert admitted <= int(60 * BURST_FRACTION) + 2
    client.delete(budget.key)
    _settled_with(budget, {"anthropic-ratelimit-requests-limit": "60"})
    assert client.hget(budget.key, "Lr") == b"60"
    fresh = RedisRateBudget(client, MODEL)  # a process started after: it reads them
    admitted = 0
    while fresh.reserve(PROMPT, 0.0).admitted and admitted < 200:
        admitted += 1
    assert admitted <= int(60 * BURST_FRACTION) + 2


def test_the_limit_an_answer_states_replaces_a_lower_one_stored_by_a_process_gone(
    client: redis.Redis,
) -> None:
    """The provider lowered the limit for a while and a process stored it, then went away;
    the one left sees the old limit in every answer again: its settlements store it, the
    cluster is not held at the lower limit for good."""
    left = RedisRateBudget(client, MODEL)
    left.learn({"anthropic-ratelimit-requests-limit": "600"})
    gone = RedisRateBudget(client, MODEL)
    gone.learn({"anthropic-ratelimit-requests-limit": "30"})
    _settled_with(left, {"anthropic-ratelimit-requests-limit": "600"})
    assert client.hget(left.key, "Lr") == b"600"


def test_a_probe_timing_out_in_a_process_that_did_not_trip_lets_the_next_go_at_once(
    client: redis.Redis,
) -> None:
    """The probe can go from any process, one with limits of its own among them (that one
    never read the breaker as a pause): its timeout ends the probe there too, not its
    20 s lease, which held every process back past their searches' deadlines."""
    tripping = RedisRateBudget(client, MODEL)
    probing = RedisRateBudget(client, MODEL, RateLimit(rpm=6000))
    tripping.trip(None)
    _half_open(client, tripping.key)
    probe = probing.reserve(PROMPT, 30.0)
    assert probe.admitted  # the probe
    assert tripping.reserve(PROMPT, 30.0).shut
    probing.unanswered(probe)
    assert tripping.reserve(PROMPT, 30.0).admitted  # the next probe


def test_an_answer_without_usage_closes_the_breaker(client: redis.Redis) -> None:
    """A probe answered 200 with a body that is not a message (no usage to settle on): the
    provider answered, so the breaker closes; before, it stayed out for its lease."""
    one, other = RedisRateBudget(client, MODEL), RedisRateBudget(client, MODEL)
    one.trip(None)
    _half_open(client, one.key)
    probe = one.reserve(PROMPT, 30.0)
    assert probe.admitted and probe.probe
    one.answered(probe)
    assert other.reserve(PROMPT, 30.0).admitted and not client.hget(one.key, "strikes")


def test_a_bucket_stamped_ahead_of_redis_s_clock_is_not_emptied_by_it(
    client: redis.Redis,
) -> None:
    """Redis's clock stepped back (a host's clock set right): the refill since the last
    stamp is none, not negative; before, a full bucket refused calls for the step."""
    budget = RedisRateBudget(client, MODEL, RateLimit(rpm=60))
    assert budget.reserve(PROMPT, 0.0).admitted
    client.hset(budget.key, "at", f"{redis_now(client) + 300:.6f}")
    assert budget.reserve(PROMPT, 0.0).admitted


def test_a_probe_answered_with_a_body_that_is_not_a_message_closes_the_breaker(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """The search's probe is answered 200, but not with a message (``malformed``, no usage):
    the provider answered all the same, so the breaker closes for every process."""
    pipeline, budget = build(fake, client, "fail_open", None, RecordingRecorder())
    budget.trip(None)
    _half_open(client, budget.key)
    fake.script([fa.body("not a message"), fa.good()])
    first = search(pipeline)
    assert first.trace["attempts"][0]["outcome"] == "malformed"
    other = RedisRateBudget(client, MODEL)
    assert other.reserve(PROMPT, 0.0).admitted and not client.hget(budget.key, "strikes")


def _paused_while_waiting(
    client: redis.Redis, seconds: float, clock: FakeClock
) -> Callable[[float], None]:
    """The search's sleep: real (the budget's waits are on Redis's clock), and moving the
    search's clock; during its first (the budget's wait), another process meets a 429
    pausing every process for ``seconds``."""
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=60))

    def sleep(wait: float) -> None:
        if not clock.sleeps:
            other.pause(seconds)
        clock.sleep(wait)
        time.sleep(wait)

    return sleep


def test_a_call_granted_with_a_wait_waits_out_a_pause_begun_meanwhile(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A call granted with a wait looks at the pause again before it is sent: a 429 another
    process met meanwhile holds it too. Before, it went out into the provider's 429."""
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=60), RecordingRecorder(), deadline=120.0,
        clock=clock, sleep=_paused_while_waiting(client, 2.0, clock),
    )  # fmt: skip
    exhaust(budget)  # the next request frees in about a second
    result = search(pipeline)
    assert result.rerank.applied and len(fake.requests()) == 1
    wait, held = clock.sleeps
    assert 0 < wait <= 1.0 + 1e-6 and 0 < held <= 2.0
    assert result.trace["attempts"][0]["budget_wait_seconds"] == pytest.approx(wait + held)


def test_a_call_granted_with_a_wait_is_not_sent_into_a_breaker_opened_meanwhile(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    """A call granted with a wait looks at the breaker again before it is sent: a 5xx
    another process met meanwhile opened it (for 3 s), so the call gives its grant back
    unsent and waits as every other call does, then goes as the probe once the opening is
    over. Before, it looked at the 429's pause alone and went out into the outage at the
    end of its wait (about a second), while every other process held back."""
    clock = FakeClock()
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=60))
    ends: list[float] = []  # each of the search's waits' end, on Redis's clock
    opened: list[float] = []  # the instant the opening ends, on Redis's clock

    def sleep(wait: float) -> None:  # real: the budget's waits are on Redis's clock
        if not clock.sleeps:
            other.trip(3.0)  # during the wait for the bucket
            opened.append(float(client.hget(other.key, "open") or 0))
        clock.sleep(wait)
        time.sleep(wait)
        ends.append(redis_now(client))

    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=60), RecordingRecorder(), deadline=120.0,
        clock=clock, sleep=sleep,
    )  # fmt: skip
    exhaust(budget)  # the next request frees in about a second
    result = search(pipeline)
    assert result.rerank.applied and len(fake.requests()) == 1
    assert ends[-1] >= opened[0] > 0  # sent after its last wait: once the opening was over
    assert 0 < clock.sleeps[0] <= 1.0 + 1e-6 and len(clock.sleeps) >= 2
    assert result.trace["attempts"][0]["budget_wait_seconds"] == pytest.approx(sum(clock.sleeps))
    assert not client.hget(budget.key, "strikes")  # the probe answered: closed


def test_a_pause_begun_during_the_wait_past_the_deadline_sends_nothing(
    fake: fa.FakeAnthropic, client: redis.Redis
) -> None:
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_open", RateLimit(rpm=60), RecordingRecorder(), deadline=10.0,
        clock=clock, sleep=_paused_while_waiting(client, 30.0, clock),
    )  # fmt: skip
    exhaust(budget)
    result = search(pipeline)
    assert fake.requests() == [] and len(clock.sleeps) == 1  # the pause was not slept
    assert result.rerank.fallback_reason == "error:budget_exhausted"
    [attempt] = result.trace["attempts"]
    assert attempt["outcome"] == "budget_exhausted"
    assert attempt["budget_wait_seconds"] > 29.0  # the wait, and the pause it would have had


# --- on a Redis at its maxmemory (noeviction), through the pipeline --------------------------


@pytest.fixture
def fill(client: redis.Redis) -> Iterator[Callable[[], None]]:
    """Fills the server when called: its memory limit set to half what it holds
    (``noeviction``, Redis's default), so that it refuses every write that may grow it; room
    again after the test."""

    def filled() -> None:
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) // 2)

    yield filled
    client.config_set("maxmemory", 0)


def still_full(client: redis.Redis) -> bool:
    """Whether the server still refuses a write that grows it: what the budget wrote meanwhile
    went in on a full Redis."""
    try:
        client.set("room?", "1")
    except redis.exceptions.OutOfMemoryError:
        return True
    return False


def test_a_batch_item_at_a_full_redis_reserves_its_call_there(
    fake: fa.FakeAnthropic, client: redis.Redis, fill: Callable[[], None]
) -> None:
    """The budget's one script writes a fixed set of fields (the buckets, the pause, the
    breaker) and one field per process: flagged ``allow-oom``, it runs on a full Redis, so a
    batch item there reserves its call and reranks, while another item of its process, let
    start, is told to the cluster in the same script call. Refused before, the reservation's
    ``OutOfMemoryError`` escaped the search: nothing reranked, nothing sent."""
    pipeline, budget = build(fake, client, "fail_closed", RateLimit(rpm=60), RecordingRecorder())
    other = threading.Thread(target=budget.started)  # another item, paced, not yet reserved
    other.start()
    other.join()
    fill()
    result = search(pipeline)
    assert result.rerank.applied is True and len(fake.requests()) == 1
    assert result.usage.requests == 1
    assert still_full(client)
    assert float(client.hget(budget.key, "r") or 60) < 60 * BURST_FRACTION  # reserved there
    assert client.hget(f"{budget.key}:pending", budget.process)  # the other item told


def test_a_billed_call_whose_answer_comes_to_a_full_redis_is_settled_and_shown(
    fake: fa.FakeAnthropic, client: redis.Redis, fill: Callable[[], None]
) -> None:
    """Redis fills while the call is out: its settlement (the unused output tokens given back)
    is written there all the same, and the search shows the call's usage. Refused before, the
    settlement's ``OutOfMemoryError`` escaped the search after the call was billed: its answer
    and usage were lost (a re-drive would call the model again), and its ``max_tokens`` held
    in the bucket until it refilled."""
    limits = RateLimit(rpm=60, otpm=6_000)
    recorder = RecordingRecorder()
    pipeline, budget = build(fake, client, "fail_closed", limits, recorder, answered=fill)
    result = search(pipeline)
    assert result.rerank.applied is True and len(fake.requests()) == 1
    used = result.usage.output_tokens
    assert result.usage.requests == 1 and used > 0
    assert recorder.events["attempt", "ok"] == 1
    assert still_full(client)
    # settled: the bucket lacks what the call used at most, not its reserved max_tokens
    assert float(client.hget(budget.key, "o") or 0) >= 6_000 * BURST_FRACTION - used


@pytest.mark.parametrize("stop", [HandedBack, Canceled], ids=["worker-stop", "cancel"])
def test_a_stop_during_the_wait_at_a_full_redis_gives_the_reservation_back(
    fake: fa.FakeAnthropic,
    client: redis.Redis,
    fill: Callable[[], None],
    stop: type[Exception],
) -> None:
    """A batch item's worker stopping (or its batch canceled) during its wait for the budget,
    Redis full meanwhile: the wait ends with the stop's own error, and the reservation goes
    back whole. Refused before, the give-back's ``OutOfMemoryError`` replaced the stop's:
    the item was taken for one whose Redis failed (left ``running`` for the re-drive) instead
    of handed back or canceled."""
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=2), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    exhaust(budget)
    before = request_wait(client, budget.key, rpm=2)(redis_now(client))

    def stopping(billed: object) -> None:  # Redis filled, then the stop, in the first second
        if clock.sleeps:
            fill()
            raise stop("the worker is stopping" if stop is HandedBack else "canceled")

    spec = SearchSpec(index="docs", query="volcano ash", limit=5)
    with pytest.raises(stop):
        pipeline.search(spec, "acme", stopping)
    assert fake.requests() == [] and still_full(client)
    after = request_wait(client, budget.key, rpm=2)(redis_now(client))
    assert after <= before  # given back: a reservation held would add 30 s


def test_a_429_answered_to_a_full_redis_pauses_every_process(
    fake: fa.FakeAnthropic, client: redis.Redis, fill: Callable[[], None]
) -> None:
    """Redis fills while the call is out, and the provider answers 429: the pause is written
    there all the same, so every process waits out its ``retry-after``, and the search falls
    back as its policy says. Refused before (the 429's settlement, then its pause), the
    ``OutOfMemoryError`` escaped the search, the 429 counted nowhere and no process paused."""
    recorder = RecordingRecorder()
    pipeline, budget = build(
        fake, client, "fail_open", RateLimit(rpm=6_000), recorder, answered=fill
    )
    fake.script([fa.status(429, retry_after=30)])
    searched_from = redis_now(client)
    result = search(pipeline)  # the retry would wait 30 s: past the 3 s deadline
    searched_by = redis_now(client)
    assert result.trace["attempts"][0]["outcome"] == "rate_limited"
    assert recorder.events["attempt", "rate_limited"] == 1
    assert result.rerank.applied is False and len(fake.requests()) == 1
    assert still_full(client)
    until = paused_until(client, budget.key)
    assert searched_from + 30.0 <= until <= searched_by + 30.0
    other = RedisRateBudget(client, MODEL, RateLimit(rpm=6_000))
    assert not other.reserve(PROMPT, max_wait=1.0).admitted  # paused


def test_a_submission_at_a_full_redis_takes_its_places_in_the_processing_queue(
    fake: fa.FakeAnthropic, client: redis.Redis, redis_url: str, fill: Callable[[], None]
) -> None:
    """Redis fills once a submission has written down the create it is about to make (its
    items' runs, written just before): the create's share of the provider's processing queue
    is taken there all the same (its script flagged ``allow-oom``), so the create is sent, its
    entry named for its provider batch and dropped when a poll sees that end; the cap still
    holds. Refused before, the take's ``OutOfMemoryError`` stopped the create unsent, its runs
    saying it was under way: the next run had to settle it as a create in doubt."""
    batches = _metered_batches(fake, redis_url, queued=8)
    assert batches.queue is not None
    requests = [{"custom_id": f"i{i}", "params": batches.request_params(PROMPT)} for i in range(6)]
    fill()
    created = batches.create(requests)
    assert len(fake.batches()) == 1 and batches.queue.queued() == 6
    assert client.hkeys(batches.queue.key) == [created.id.encode()]
    with pytest.raises(BatchQueueFull):
        batches.create(requests)  # 12 would be queued: not sent
    assert len(fake.batches()) == 1
    assert batches.retrieve(created.id).ended  # the fake processes at once
    assert batches.queue.queued() == 0
    assert still_full(client)


# --- Redis gone (stopped) past the client's retries, through the pipeline ------------------


@pytest.fixture
def gone(tmp_path: Path) -> Iterator[tuple[redis.Redis, Callable[[], None]]]:
    """A client with a worker's options (its outage retries cut to half a second) on a
    redis-server of the test's own, and what stops that server: each call after it meets the
    connection refused past the retries (``ConnectionError``)."""
    server = contextlib.ExitStack()
    url = server.enter_context(redis_server(tmp_path / "redis"))
    client = connect(url + "/0", outage_seconds=0.5, socket_timeout=QUICK_SOCKET_TIMEOUT)
    try:
        yield client, server.close
    finally:
        client.close()
        server.close()


def unsettled() -> float:
    """The settlements with the standard lane's budget that Redis failed, so far."""
    labels = {"model": MODEL, "lane": "standard"}
    return REGISTRY.get_sample_value("sift_rate_budget_unsettled_total", labels) or 0.0


@pytest.mark.parametrize(
    ("answer", "outcome"), [(fa.good(), "ok"), (fa.refusal(), "refused")], ids=["ok", "refused"]
)
def test_a_billed_answer_whose_settlement_meets_redis_gone_is_shown(
    fake: fa.FakeAnthropic,
    gone: tuple[redis.Redis, Callable[[], None]],
    answer: fa.Behaviour,
    outcome: str,
) -> None:
    """Redis stops while the call is out: the settlement of its answer (billed: a ranking,
    or a refusal) meets the connection refused past the client's retries, and is logged and
    counted; the search shows the call and its usage all the same, reranked or fallen back
    as its policy says. Before, the settlement's ``ConnectionError`` escaped the search after
    the call was billed: its answer and usage were lost (the run left ``running``, kept
    nowhere, for a re-drive that called the model again)."""
    client, stop_redis = gone
    recorder = RecordingRecorder()
    limits = RateLimit(rpm=60, otpm=6_000)
    pipeline, _ = build(fake, client, "fail_open", limits, recorder, answered=stop_redis)
    fake.script([answer])
    before = unsettled()
    result = search(pipeline)
    assert len(fake.requests()) == 1
    assert result.usage.requests == 1 and result.usage.output_tokens > 0
    assert [a["outcome"] for a in result.trace["attempts"]] == [outcome]
    assert recorder.events["attempt", outcome] == 1
    assert result.rerank.applied is (outcome == "ok")
    assert unsettled() == before + 1
    with pytest.raises(redis.ConnectionError):
        client.ping()  # the premise: Redis gone


@pytest.mark.parametrize("stop", [HandedBack, Canceled], ids=["worker-stop", "cancel"])
def test_a_stop_during_the_wait_with_redis_gone_is_that_stop(
    fake: fa.FakeAnthropic, gone: tuple[redis.Redis, Callable[[], None]], stop: type[Exception]
) -> None:
    """A batch item's worker stopping (or its batch canceled) during its wait for the budget,
    Redis stopped meanwhile: the give-back of its reservation meets the connection refused
    past the client's retries, and is logged and counted; the wait ends with the stop's own
    error. Before, the give-back's ``ConnectionError`` replaced it: the item was taken for one
    whose Redis failed (left ``running`` for the re-drive) instead of handed back or
    canceled. The reservation it held stays taken until the bucket refills it."""
    client, stop_redis = gone
    clock = FakeClock()
    pipeline, budget = build(
        fake, client, "fail_closed", RateLimit(rpm=2), RecordingRecorder(),
        deadline=120.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    exhaust(budget)
    before = unsettled()

    def stopping(billed: object) -> None:  # Redis stopped, then the stop, in the first second
        if clock.sleeps:
            stop_redis()
            raise stop("the worker is stopping" if stop is HandedBack else "canceled")

    spec = SearchSpec(index="docs", query="volcano ash", limit=5)
    with pytest.raises(stop):
        pipeline.search(spec, "acme", stopping)
    assert fake.requests() == []
    assert unsettled() == before + 1


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (fa.status(429, retry_after=30), "rate_limited"),  # the cluster's pause
        (fa.status(529), "http_5xx"),  # the breaker's trip
        (fa.body('{"not": "a message"}'), "malformed"),  # the breaker's close
    ],
    ids=["429-pause", "5xx-trip", "answer-close"],
)
def test_a_failed_attempt_whose_breaker_or_pause_meets_redis_gone_is_counted(
    fake: fa.FakeAnthropic,
    gone: tuple[redis.Redis, Callable[[], None]],
    answer: fa.Behaviour,
    outcome: str,
) -> None:
    """Redis stops while the call is out, and the provider answers a 429 (the cluster's
    pause), a 529 (the breaker opens) or a 200 that is no message (the breaker closes): that
    write meets the connection refused past the client's retries and raises, the run left
    for the outage's re-drive (its deadline spent on the client's retries: going on, the
    outage was charged to the job), but the attempt is counted first: the call was made.
    Before, the write came before the count, and the attempt was counted nowhere."""
    client, stop_redis = gone
    recorder = RecordingRecorder()
    pipeline, _ = build(fake, client, "fail_open", RateLimit(rpm=60), recorder, answered=stop_redis)
    fake.script([answer])
    with pytest.raises(redis.ConnectionError):
        search(pipeline)
    assert len(fake.requests()) == 1
    assert recorder.events["attempt", outcome] == 1


def test_a_probe_unanswered_whose_end_meets_redis_gone_is_counted(
    fake: fa.FakeAnthropic, gone: tuple[redis.Redis, Callable[[], None]]
) -> None:
    """The breaker half open, the search's call is its probe; Redis stops as it is sent, and
    the connection drops with no answer: the probe's end (the next may go at once) meets the
    connection refused and raises, the run left for the outage's re-drive, but the attempt
    and its unread input are counted first. Before, neither was."""
    client, stop_redis = gone
    recorder = RecordingRecorder()
    pipeline, budget = build(
        fake, client, "fail_open", RateLimit(rpm=60), recorder, sending=stop_redis
    )
    budget.trip(0.001)  # open for a millisecond: the next call is the probe
    time.sleep(0.01)
    fake.script([fa.drop()])
    with pytest.raises(redis.ConnectionError):
        search(pipeline)
    assert len(fake.requests()) == 1
    assert recorder.events["attempt", "connection"] == 1
    assert recorder.events["unread", MODEL] == 1  # sent, no answer read: it may be billed


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (fa.malformed("not a ranking"), "malformed"),  # billed: settled on its usage
        (fa.status(409), "http_5xx"),  # retried as a 5xx: its tokens given back
    ],
    ids=["malformed-billed", "409"],
)
def test_a_retried_attempt_whose_settlement_meets_redis_gone_raises(
    fake: fa.FakeAnthropic,
    gone: tuple[redis.Redis, Callable[[], None]],
    answer: fa.Behaviour,
    outcome: str,
) -> None:
    """Redis stops while the call is out, and the provider answers what is retried with no
    other write of the budget's after the settlement: a billed answer not in the schema, or a
    409. The settlement meets the connection refused past the client's retries and raises, as
    a 429's pause or the breaker's write there does: the run is left for the outage's
    re-drive, the attempt (and its usage) counted first. The test's clock moves by the
    deadline as Redis stops: the client's retries at the defaults (30 s, cut here to half a
    second) spend the default deadline. Before, the settlement was dropped, the run went on
    with no time left and fell back: the outage charged to the job."""
    client, stop_redis = gone
    clock = FakeClock()
    recorder = RecordingRecorder()

    def outage() -> None:
        stop_redis()
        clock.now += 30.0

    pipeline, _ = build(
        fake, client, "fail_open", RateLimit(rpm=60), recorder,
        deadline=30.0, clock=clock, sleep=clock.sleep, answered=outage,
    )  # fmt: skip
    fake.script([answer, fa.good()])
    before = unsettled()
    with pytest.raises(redis.ConnectionError):
        search(pipeline)
    assert len(fake.requests()) == 1
    assert recorder.events["attempt", outcome] == 1
    assert (recorder.usage["output"] > 0) is (outcome == "malformed")
    assert unsettled() == before  # raised, not dropped
