"""worker.observability.metrics: the recorder through the real pipeline, closed labels, backlog,
multiprocess."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.metrics import MetricWrapperBase

from tests.fakes import USAGE, FakeEmbedder, InMemoryBackend, ScriptedReranker, fail, reply
from worker import errors
from worker.constants import POLICY_ID, SEARCH_QUEUE
from worker.contract import DocumentIn, SearchSpec
from worker.core.cost import cost_usd, price_for
from worker.core.types import TokenUsage
from worker.errors import AttemptOutcome, RerankAttemptError
from worker.observability import metrics
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.settings import DEFAULT_PRICES, load_settings

ROOT = Path(__file__).resolve().parents[2]
MODEL = "claude-haiku-4-5"


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Delta:
    """Sample values before and after a block, from the default registry."""

    def __init__(self) -> None:
        self.before = dict(metrics.snapshot(REGISTRY))

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return metrics.snapshot(REGISTRY).get(key, 0.0) - self.before.get(key, 0.0)


def pipeline_with(steps: list[object], policy: str = "fail_open", **overrides: object) -> Runtime:
    settings = load_settings(
        rerank_enabled=True,
        generation_model=f"anthropic:{MODEL}",
        rerank_failure_policy=policy,
        generation_max_requests=3,
        **overrides,
    )
    pipeline = build_pipeline(
        settings,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
        reranker=metrics.InFlightReranker(ScriptedReranker(steps)),  # type: ignore[arg-type]
        recorder=metrics.PrometheusRecorder(),
        sleep=lambda seconds: None,
    )
    runtime = Runtime(pipeline)
    docs = [DocumentIn(id=f"d{i}", text=f"volcano ash eruption note {i}") for i in range(12)]
    runtime.ingest("docs", "acme", docs)
    return runtime


def test_the_pipeline_reports_through_the_prometheus_recorder() -> None:
    steps = [fail(RerankAttemptError(AttemptOutcome.RATE_LIMITED, "slow down")), reply([2, 1])]
    runtime = pipeline_with(steps)
    delta = Delta()
    result = runtime.search(SearchSpec(index="docs", query="volcano ash", limit=3), "acme")
    assert result.rerank.applied

    assert (
        delta("sift_rerank_attempts_total", model=MODEL, result="rate_limited", lane="standard")
        == 1
    )
    assert delta("sift_rerank_attempts_total", model=MODEL, result="ok", lane="standard") == 1
    assert delta("sift_rerank_outcomes_total", policy=POLICY_ID, outcome="applied") == 1
    assert (
        delta("sift_rerank_duration_seconds_count", model=MODEL, outcome="ok", lane="standard") == 1
    )
    assert delta("sift_search_duration_seconds_count", mode="hybrid", outcome="ok") == 1
    # every stage before the model, Sift's own included: the query embedding, the fusion
    for channel in ("bm25", "knn", "embed", "fuse"):
        counted = delta("sift_retrieval_duration_seconds_count", backend="memory", channel=channel)
        assert counted == 1, channel

    tokens = {
        "input": USAGE.input_tokens,
        "output": USAGE.output_tokens,
        "cache_read": USAGE.cache_read_input_tokens,
        "cache_creation": USAGE.cache_creation_input_tokens,
    }
    for token_type, expected in tokens.items():
        got = delta("sift_rerank_tokens_total", model=MODEL, type=token_type, lane="standard")
        assert got == expected
        assert getattr(result.usage, _usage_field(token_type)) == expected
    expected_cost = cost_usd(USAGE, price_for(MODEL, DEFAULT_PRICES))
    assert expected_cost > 0
    cost = delta("sift_rerank_cost_usd_total", model=MODEL, lane="standard")
    assert cost == pytest.approx(expected_cost, rel=1e-12)
    assert cost == pytest.approx(result.usage.cost_usd, rel=1e-12)
    assert value("sift_rerank_in_flight", model=MODEL) == 0


def _usage_field(token_type: str) -> str:
    return {
        "input": "input_tokens",
        "output": "output_tokens",
        "cache_read": "cache_read_input_tokens",
        "cache_creation": "cache_creation_input_tokens",
    }[token_type]


def test_a_failed_rerank_counts_its_class_and_the_failure() -> None:
    runtime = pipeline_with(
        [fail(RerankAttemptError(AttemptOutcome.HTTP_4XX, "bad"))], "fail_closed"
    )
    delta = Delta()
    with pytest.raises(errors.RerankFailed):
        runtime.search(SearchSpec(index="docs", query="volcano", limit=3), "acme")
    assert delta("sift_rerank_attempts_total", model=MODEL, result="http_4xx", lane="standard") == 1
    assert delta("sift_rerank_outcomes_total", policy=POLICY_ID, outcome="failed") == 1
    assert (
        delta(
            "sift_rerank_duration_seconds_count", model=MODEL, outcome="http_4xx", lane="standard"
        )
        == 1
    )
    assert delta("sift_search_duration_seconds_count", mode="hybrid", outcome="error") == 1
    assert delta("sift_rerank_cost_usd_total", model=MODEL, lane="standard") == 0


def test_each_channel_shows_how_many_hits_it_returned_and_fusion_how_many_it_kept() -> None:
    """The work of each stage before the model, not only its time: hits per channel (an
    empty channel is the le="0.0" bucket) and the candidates fusion kept."""
    runtime = pipeline_with([reply([1])])
    delta = Delta()
    result = runtime.search(
        SearchSpec(index="docs", query="volcano ash", limit=3, include_trace=True), "acme"
    )
    assert result.trace is not None
    counts = dict(result.trace["channel_counts"])
    counts["fuse"] = len(result.trace["candidates"])
    assert counts["bm25"] > 0 and counts["knn"] > 0 and counts["fuse"] > 0
    for channel, hits in counts.items():
        labels = {"backend": "memory", "channel": channel}
        assert delta("sift_retrieval_hits_count", **labels) == 1, channel
        assert delta("sift_retrieval_hits_sum", **labels) == hits, channel
    # a query no document matches: BM25 returns nothing, counted in the zero bucket
    runtime.search(SearchSpec(index="docs", query="zyzzyva", limit=3, mode="fts"), "acme")
    assert delta("sift_retrieval_hits_bucket", backend="memory", channel="bm25", le="0.0") == 1


def test_a_billed_attempt_is_counted_even_when_the_search_then_dies() -> None:
    """Tokens and dollars are counted as each call reports them, not when the rerank ends: a
    malformed answer is billed, and if the search then dies (an unexpected error, the task
    killed, the item canceled in the economy lane between rounds) the bill still shows."""
    billed = TokenUsage(input_tokens=1234, output_tokens=56, cache_read_input_tokens=700)
    malformed = RerankAttemptError(AttemptOutcome.MALFORMED, "not the schema")
    malformed.usage = billed  # type: ignore[attr-defined]  # as the Anthropic adapter attaches it
    runtime = pipeline_with([fail(malformed), fail(RuntimeError("the worker died"))])
    delta = Delta()
    with pytest.raises(RuntimeError):
        runtime.search(SearchSpec(index="docs", query="volcano ash", limit=3), "acme")
    lane = {"model": MODEL, "lane": "standard"}
    assert delta("sift_rerank_tokens_total", type="input", **lane) == 1234
    assert delta("sift_rerank_tokens_total", type="output", **lane) == 56
    assert delta("sift_rerank_tokens_total", type="cache_read", **lane) == 700
    price = price_for(MODEL, DEFAULT_PRICES)
    assert delta("sift_rerank_cost_usd_total", **lane) == pytest.approx(cost_usd(billed, price))


def test_calls_to_a_model_with_no_price_are_counted_and_cost_nothing_known() -> None:
    steps = [fail(RerankAttemptError(AttemptOutcome.TIMEOUT, "slow")), reply([2, 1])]
    runtime = pipeline_with(steps, prices={})
    delta = Delta()
    result = runtime.search(SearchSpec(index="docs", query="volcano ash", limit=3), "acme")
    assert result.usage.cost_usd is None
    # the timeout reported no usage; only the call that did is an unpriced one
    assert delta("sift_rerank_unpriced_calls_total", model=MODEL, lane="standard") == 1
    assert delta("sift_rerank_cost_usd_total", model=MODEL, lane="standard") == 0
    assert delta("sift_rerank_tokens_total", model=MODEL, type="input", lane="standard") == (
        USAGE.input_tokens
    )


def test_unexpected_label_values_are_recorded_as_other() -> None:
    delta = Delta()
    recorder = metrics.PrometheusRecorder()
    recorder.rerank_attempt(MODEL, "a-query-text-that-must-not-become-a-label")
    recorder.search_done("mystery", "ok", 0.1)
    metrics.job_completed("search", "failed", "SomethingNew")
    assert delta("sift_rerank_attempts_total", model=MODEL, result="other", lane="standard") == 1
    assert delta("sift_search_duration_seconds_count", mode="other", outcome="ok") == 1
    assert delta("sift_job_failures_total", kind="search", error="other") == 1


def test_the_native_fusion_channel_is_preregistered_only_where_the_backend_fuses() -> None:
    """``rrf`` (Elasticsearch's own fusion, SIFT_ELASTICSEARCH_NATIVE_RRF) is made at zero for
    a backend that fuses natively; elsewhere no such stage runs, so no such series shows."""
    metrics.preregister(backend="fuses-natively", native_fusion=True)
    metrics.preregister(backend="fuses-in-sift")
    name = "sift_retrieval_duration_seconds_count"
    assert REGISTRY.get_sample_value(name, {"backend": "fuses-natively", "channel": "rrf"}) == 0
    assert REGISTRY.get_sample_value(name, {"backend": "fuses-in-sift", "channel": "rrf"}) is None
    assert REGISTRY.get_sample_value(name, {"backend": "fuses-in-sift", "channel": "fuse"}) == 0
    hits = "sift_retrieval_hits_count"  # the native fusion's kept candidates count as "fuse"
    assert REGISTRY.get_sample_value(hits, {"backend": "fuses-natively", "channel": "rrf"}) is None


@pytest.mark.parametrize(
    ("backend", "native", "expected"),
    [("elasticsearch", True, True), ("elasticsearch", False, False), ("embedded", True, False)],
)
def test_the_backend_fuses_natively_only_elasticsearch_with_native_rrf(
    backend: str, native: bool, expected: bool
) -> None:
    settings = load_settings(
        search_backend=backend, elasticsearch_url="http://es:9200", elasticsearch_native_rrf=native
    )
    assert settings.native_fusion is expected


def test_the_recorder_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    recorder = metrics.PrometheusRecorder()
    recorder.rerank_usage(MODEL, {"input": -5}, -1.0)  # counters refuse negatives
    assert "recording a metric failed" in caplog.text


def test_job_helpers() -> None:
    delta = Delta()
    metrics.job_submitted("batch_item", 5)
    metrics.job_completed("batch_item", "succeeded")
    metrics.job_completed("batch_item", "failed", "rerank_failed")
    metrics.job_completed("batch_item", "canceled", count=3)
    metrics.observe_queue_wait(SEARCH_QUEUE, 0.3)
    metrics.webhook_delivery("retry")
    metrics.webhook_deferred("batch.completed")
    metrics.webhook_deferred("ping")  # not an event Sift sends: "other"
    with metrics.running_job():
        assert value("sift_jobs_in_flight", state="running") >= 1
    assert delta("sift_jobs_submitted_total", kind="batch_item") == 5
    assert delta("sift_jobs_completed_total", kind="batch_item", status="succeeded") == 1
    assert delta("sift_jobs_completed_total", kind="batch_item", status="failed") == 1
    assert delta("sift_jobs_completed_total", kind="batch_item", status="canceled") == 3
    assert delta("sift_job_failures_total", kind="batch_item", error="rerank_failed") == 1
    assert delta("sift_job_queue_wait_seconds_count", queue=SEARCH_QUEUE) == 1
    assert delta("sift_webhook_deliveries_total", result="retry") == 1
    assert delta("sift_webhook_deferrals_total", type="batch.completed") == 1
    assert delta("sift_webhook_deferrals_total", type="other") == 1
    assert delta("sift_jobs_in_flight", state="running") == 0


class FakeRedis:
    def __init__(self, lists: dict[str, int]) -> None:
        self.lists = lists

    def llen(self, name: str) -> int:
        return self.lists.get(name, 0)


def test_update_backlog_counts_every_priority_list_of_a_queue() -> None:
    redis = FakeRedis({"sift.search": 4, "sift.search\x06\x163": 2, "sift.webhooks": 1})
    lengths = metrics.update_backlog(redis, ["sift.search", "sift.webhooks", "sift.ingest"])
    assert lengths == {"sift.search": 6, "sift.webhooks": 1, "sift.ingest": 0}
    assert value("sift_queue_backlog", queue="sift.search") == 6
    assert value("sift_queue_backlog", queue="sift.ingest") == 0


def test_every_error_code_is_a_known_failure_class() -> None:
    codes = {
        cls.code
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.SiftError)
    }
    codes.discard("error")  # the abstract root
    assert codes <= set(metrics.JOB_ERRORS)


def test_every_attempt_class_is_a_closed_label_value() -> None:
    assert {o.value for o in AttemptOutcome} == set(metrics.ATTEMPT_RESULTS)


def test_buckets_suit_their_range() -> None:
    assert metrics.SEARCH_LATENCY_GOAL_SECONDS in metrics.SEARCH_BUCKETS
    assert 1.0 in metrics.SEARCH_BUCKETS
    assert metrics.RERANK_BUCKETS[0] == 0.25 and 60.0 in metrics.RERANK_BUCKETS
    assert metrics.RETRIEVAL_BUCKETS[0] <= 0.0001  # Sift's own fusion takes about that
    assert metrics.RETRIEVAL_BUCKETS[-1] >= load_settings().search_deadline_seconds


@pytest.mark.parametrize("buckets", ["SEARCH_BUCKETS", "RERANK_BUCKETS"])
def test_a_search_cut_by_the_default_deadline_is_read_as_taking_it(buckets: str) -> None:
    """A search (and its rerank) the deadline cuts ends a few milliseconds past it: with no
    bucket between 30 and 60 s, each fell in (30, 60], and the dashboards' percentiles read
    45-59 s for searches that all took 30.01-30.03 s."""
    deadline = load_settings().search_deadline_seconds
    bounds = getattr(metrics, buckets)
    assert deadline in bounds
    assert any(deadline < bound <= deadline + 1 for bound in bounds), bounds


def _finite_buckets_hit(
    before: Mapping[tuple[str, tuple[tuple[str, str], ...]], float],
    bucket: str,
    label: str,
    label_value: str,
) -> list[float]:
    """The finite upper bounds (``le``) of ``bucket`` whose count for ``label=label_value``
    rose since ``before``: where an observation landed, +Inf left out."""
    return [
        float(dict(labels)["le"])
        for (name, labels), count in metrics.snapshot(REGISTRY).items()
        if name == bucket
        and dict(labels).get(label) == label_value
        and dict(labels)["le"] != "+Inf"
        and count - before.get((name, labels), 0.0) >= 1
    ]


@pytest.mark.parametrize("seconds", [90.0, 20 * 60.0, 5 * 3600.0])
def test_an_economy_rerank_of_minutes_to_hours_lands_in_a_finite_bucket(seconds: float) -> None:
    """An economy rerank is timed from its provider batch's submission to the answer:
    minutes to hours. Each percentile must be estimable, not all of it +Inf (read as 60 s)."""
    before = dict(metrics.snapshot(REGISTRY))
    metrics.PrometheusRecorder(lane="economy").rerank_done(MODEL, "ok", seconds)
    counted = _finite_buckets_hit(before, "sift_rerank_duration_seconds_bucket", "lane", "economy")
    assert counted, f"an economy rerank of {seconds} s fell in +Inf only"
    assert min(counted) <= 4 * seconds  # and the bucket that holds it is not far above it


def _quantile_read(bounds: tuple[float, ...], seconds: float, q: float) -> float:
    """What Prometheus's ``histogram_quantile(q, ...)`` reads off a histogram with ``bounds``
    holding one observation of ``seconds``: interpolated linearly within the bucket that holds
    it, from the bucket's lower bound (0 for the first)."""
    histogram = Histogram("probe", "one observation", buckets=bounds, registry=CollectorRegistry())
    histogram.observe(seconds)
    lower = 0.0
    for sample in next(iter(histogram.collect())).samples:
        if sample.name.endswith("_bucket") and sample.value >= 1:
            upper = float(sample.labels["le"])
            return lower + (upper - lower) * q
        if sample.name.endswith("_bucket"):
            lower = float(sample.labels["le"])
    raise AssertionError(f"{seconds} s fell in no bucket")


@pytest.mark.parametrize(  # 3 ms to about 19 h
    "seconds", [0.003 * 1.7**n for n in range(33)], ids=lambda seconds: f"{seconds:.3g}s"
)
def test_a_queue_wait_reads_back_within_a_factor_of_2_5(seconds: float) -> None:
    """The dashboards read queue waits as ``histogram_quantile``: from 3 ms (a search taken at
    once) to most of a day (a webhook retry, a search queued while the workers were down
    overnight), p50 and p95 must read close to what the jobs waited. The buckets stopped at
    4 h: a wait of 6 h read as 4 h at p50 and p95. With buckets five times apart (1 s then
    5 s) a wait of 1.1 s read 4.8 s at p95."""
    for q in (0.5, 0.95):
        read = _quantile_read(metrics.QUEUE_WAIT_BUCKETS, seconds, q)
        assert seconds / 2.5 <= read <= seconds * 2.5, (q, seconds, read)


def test_every_task_run_the_time_limits_allow_fits_the_buckets() -> None:
    from worker.queue.config import time_limits

    longest = max(hard for _, hard in time_limits(load_settings()).values())
    assert max(metrics.TASK_DURATION._upper_bounds[:-1]) >= longest


def test_the_longest_economy_rerank_fits_the_buckets() -> None:
    assert metrics.RERANK_BUCKETS[-1] >= load_settings().economy_deadline_seconds


def test_a_slow_retrieval_lands_in_a_finite_bucket() -> None:
    before = dict(metrics.snapshot(REGISTRY))
    metrics.PrometheusRecorder().retrieval("elasticsearch", "bm25", 3.0)
    counted = _finite_buckets_hit(
        before, "sift_retrieval_duration_seconds_bucket", "backend", "elasticsearch"
    )
    assert counted and min(counted) <= 4 * 3.0


def test_metrics_module_imports_no_core() -> None:
    code = (
        "import sys, worker.observability.metrics; "
        "print(sorted(m for m in sys.modules if m.startswith('worker')"
        " and not m.startswith('worker.observability.metrics.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == (
        "['worker', 'worker.constants', 'worker.observability', 'worker.observability.metrics',"
        " 'worker.pids']"
    )


# --- multiprocess mode, in a fresh interpreter so this process's registry stays untouched ---

MULTIPROCESS_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, sys, time
    from pathlib import Path
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector
    from worker.observability import metrics

    directory = Path(sys.argv[1])
    (directory / "counter_999999.db").parent.mkdir(parents=True, exist_ok=True)
    (directory / "counter_999999.db").write_bytes(b"stale")  # an earlier run's leftovers
    metrics.setup_multiprocess(directory)
    assert not (directory / "counter_999999.db").exists()
    metrics.preregister(models=["m"])

    def child(n, hold):
        recorder = metrics.PrometheusRecorder()
        for _ in range(n):
            recorder.rerank_attempt("m", "ok")
            recorder.rerank_usage("m", {"input": 10, "output": 2}, 0.25)
            recorder.rerank_done("m", "ok", 0.5)
        metrics.RERANK_IN_FLIGHT.labels("m").inc()  # still "in flight" when it exits
        if hold is not None:
            hold.wait()

    ctx = multiprocessing.get_context("fork")
    done = [ctx.Process(target=child, args=(n, None)) for n in (3, 4)]
    for p in done:
        p.start()
    for p in done:
        p.join()
    metrics.mark_process_dead(done[0].pid)      # the hook ran for one child ...
    raw = CollectorRegistry()                    # no sweep: what the files say as they are
    MultiProcessCollector(raw, path=str(directory))
    before_sweep = metrics.snapshot(raw)
    hold = ctx.Event()
    alive = ctx.Process(target=child, args=(1, hold))
    alive.start()
    ok_labels = (("lane", "standard"), ("model", "m"), ("result", "ok"))
    ok_key = ("sift_rerank_attempts_total", ok_labels)
    while metrics.snapshot().get(ok_key) != 8:   # wait for the live child to record
        time.sleep(0.01)
    with_live = metrics.snapshot()
    hold.set()
    alive.join()
    after = metrics.snapshot()                   # ... the sweep forgets the others
    def key(name, **labels):
        return (name, tuple(sorted(labels.items())))
    print(json.dumps({
        "attempts": after[("sift_rerank_attempts_total", ok_labels)],
        "input": after[key("sift_rerank_tokens_total", model="m", type="input", lane="standard")],
        "cost": after[key("sift_rerank_cost_usd_total", model="m", lane="standard")],
        "count": after[
            key("sift_rerank_duration_seconds_count", model="m", outcome="ok", lane="standard")
        ],
        "in_flight_live": with_live[key("sift_rerank_in_flight", model="m")],
        "in_flight_before_sweep": before_sweep[key("sift_rerank_in_flight", model="m")],
        "in_flight_after": after[key("sift_rerank_in_flight", model="m")],
    }))
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "multiprocess_check.py"
    path.write_text(MULTIPROCESS_SCRIPT)
    yield path


def test_multiprocess_mode_sums_children_and_forgets_dead_ones(
    script: Path, tmp_path: Path
) -> None:
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "prom")],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["attempts"] == 8  # 3 + 4 + 1: nothing lost when children exit, nothing doubled
    assert got["input"] == 80
    assert got["cost"] == pytest.approx(2.0)
    assert got["count"] == 8
    # The first child was marked dead by the hook; the second died without it, so only
    # the sweep at exposition forgets it; the live one still counts.
    assert got["in_flight_before_sweep"] == 1
    assert got["in_flight_live"] == 1
    assert got["in_flight_after"] == 0


def test_setup_multiprocess_refuses_once_something_was_recorded(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        from worker.observability import metrics
        metrics.webhook_delivery("delivered")
        try:
            metrics.setup_multiprocess(sys.argv[1])
        except RuntimeError as exc:
            print(exc)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "must run before anything is recorded" in run.stdout, run.stderr


def test_a_value_file_still_being_created_is_skipped_not_a_failed_scrape(tmp_path: Path) -> None:
    """A process that starts creates its file empty and writes the header a moment later:
    prometheus-client's own collector fails the whole scrape on it (``struct.error``)."""
    import struct

    from prometheus_client import CollectorRegistry
    from prometheus_client.mmap_dict import MmapedDict
    from prometheus_client.multiprocess import MultiProcessCollector

    written = MmapedDict(str(tmp_path / "counter_101.db"))
    key = json.dumps(["sift_demo", "sift_demo_total", {}, "demo"], sort_keys=True)
    written.write_value(key, 3.0, 0.0)
    written.close()
    (tmp_path / "counter_102.db").touch()  # another process's, just created
    plain = CollectorRegistry()
    MultiProcessCollector(plain, path=str(tmp_path))  # type: ignore[no-untyped-call]
    with pytest.raises(struct.error):
        metrics.snapshot(plain)
    registry = CollectorRegistry()
    metrics.SweepingCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    assert metrics.snapshot(registry)[("sift_demo_total", ())] == 3.0


def test_all_metrics_holds_every_metric_of_the_package() -> None:
    """setup_multiprocess() refuses to start once any metric has a value; it can only tell
    for the metrics in ALL_METRICS (the task metrics were once left out). Each is defined in
    one of the package's modules, and importable from the package."""
    values = [m for module in metrics_modules() for m in vars(module).values()]
    defined = {m for m in values if isinstance(m, MetricWrapperBase)}
    assert set(metrics.ALL_METRICS) == defined
    assert {m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)} == defined


def metrics_modules() -> list[ModuleType]:
    """The metrics package's own modules, where the metrics are defined."""
    found = pkgutil.iter_modules(metrics.__path__, metrics.__name__ + ".")
    return [importlib.import_module(info.name) for info in found]


def test_setup_multiprocess_warns_when_a_running_process_shares_the_folder(
    tmp_path: Path,
) -> None:
    """Two ``sift worker`` (or a worker and a gateway) given one PROMETHEUS_MULTIPROC_DIR: the
    one starting empties the other's live files. It says so, naming the running pid; files of
    a process that is gone are emptied without a word."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (folder / f"counter_{other.pid}.db").write_bytes(b"x" * 16)
        (folder / "gauge_livesum_999999.db").write_bytes(b"x" * 16)  # no such process
        code = textwrap.dedent(
            """
            import logging, sys
            logging.basicConfig(level=logging.WARNING, format="%(message)s")
            from worker.observability import metrics
            metrics.setup_multiprocess(sys.argv[1])
            """
        )
        run = subprocess.run(
            [sys.executable, "-c", code, str(folder)],
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        other.kill()
        other.wait()
    assert run.returncode == 0, run.stderr
    assert f"running pid(s) {other.pid}:" in run.stderr, run.stderr
    assert "999999" not in run.stderr
    assert list(folder.glob("*.db")) == []


def test_a_dead_process_marked_dead_by_its_supervisor_and_a_sweep_at_once_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor marks a child dead as it exits while a scrape's sweep finds the same pid
    gone: both remove its live-gauge files. prometheus-client's ``mark_process_dead`` lists
    them, then removes them, and raised FileNotFoundError in whichever came second: in the
    supervisor, that killed the thread that restarts the children."""
    import threading

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    modes = ("livesum", "liveall", "livemin", "livemax", "livemostrecent")
    failures: list[BaseException] = []

    def at_once(both: threading.Barrier, drop: Callable[[], object]) -> None:
        both.wait()
        try:
            drop()
        except Exception as exc:
            failures.append(exc)

    def supervisor() -> None:
        metrics.mark_process_dead(gone.pid)

    def scrape() -> None:
        metrics.sweep_dead_processes(tmp_path)

    for _ in range(300):
        for mode in modes:
            (tmp_path / f"gauge_{mode}_{gone.pid}.db").write_bytes(b"x" * 16)
        both = threading.Barrier(2)
        threads = [
            threading.Thread(target=at_once, args=(both, drop)) for drop in (supervisor, scrape)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
    assert list(tmp_path.glob("*.db")) == []


_COUNTER_KEY = json.dumps(["sift_demo", "sift_demo_total", {}, "demo"])
_BUCKET_KEY = json.dumps(["sift_took", "sift_took_bucket", {"le": "1.0"}, "took"])
_SUM_KEY = json.dumps(["sift_took", "sift_took_sum", {}, "took"])


def _write_process_files(folder: Path, pid: int, count: float) -> None:
    """The files a process of ``pid`` leaves: a counter, a histogram, a live gauge."""
    from prometheus_client.mmap_dict import MmapedDict

    for name, values in (
        (f"counter_{pid}.db", {_COUNTER_KEY: count}),
        (f"histogram_{pid}.db", {_BUCKET_KEY: count, _SUM_KEY: count / 2}),
        (f"gauge_livesum_{pid}.db", {json.dumps(["sift_on", "sift_on", {}, "on"]): 1.0}),
    ):
        written = MmapedDict(str(folder / name))
        for key, value in values.items():
            written.write_value(key, value, 0.0)
        written.close()


def _dead_pids(n: int, start: int = 0) -> list[int]:
    """Process ids no process can have: past the kernel's pid_max."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    return [top + start + i for i in range(n)]


def test_a_dead_process_files_are_merged_so_counts_stay_and_files_do_not_pile_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each restarted worker process left its counter and histogram files behind for good
    (only its live gauges went): over many restarts the folder grew, and each scrape read
    every file. Its counts now go into one merged file (``counter_merged.db``,
    ``histogram_merged.db``) and its files are removed: by the supervisor once the process
    has exited, else by a scrape's sweep. No count is lost or doubled."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    registry = CollectorRegistry()
    metrics.SweepingCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    bucket = ("sift_took_bucket", (("le", "1.0"),))
    _write_process_files(tmp_path, os.getpid(), 5.0)  # a live process: its files stay
    for round_ in range(3):
        dead = _dead_pids(20, start=20 * round_)
        for pid in dead:
            _write_process_files(tmp_path, pid, 1.0)
        for pid in dead[:10]:  # the supervisor's, as each exits
            metrics.merge_dead_process(pid)
        got = metrics.snapshot(registry)  # the sweep merges the other ten
        assert got[("sift_demo_total", ())] == 5 + 20 * (round_ + 1), got
        assert got[bucket] == 5 + 20 * (round_ + 1), got
        assert got[("sift_took_sum", ())] == pytest.approx(2.5 + 10 * (round_ + 1)), got
        assert got[("sift_on", ())] == 1.0, got  # the live process's gauge alone
        assert sorted(p.name for p in tmp_path.glob("*.db")) == sorted(
            [f"counter_{os.getpid()}.db", f"histogram_{os.getpid()}.db",
             f"gauge_livesum_{os.getpid()}.db", "counter_merged.db", "histogram_merged.db"]
        )  # fmt: skip


def test_a_scrape_during_merges_never_sees_a_count_go_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge adds a dead process's counts to the merged file and removes its file; a
    scrape reading between the two would count them twice, and the next one less: a
    counter going back, which Prometheus reads as a reset. Scrapes and merges take turns."""
    import threading

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    dead = _dead_pids(200)
    for pid in dead:
        _write_process_files(tmp_path, pid, 1.0)
    registry = CollectorRegistry()
    metrics.SweepingCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    merged = threading.Event()
    seen: list[float] = []
    failures: list[BaseException] = []

    def merge_all() -> None:
        try:
            for pid in dead:
                metrics.merge_dead_process(pid)
        except Exception as exc:
            failures.append(exc)
        finally:
            merged.set()

    def scrape() -> None:
        try:
            seen.append(metrics.snapshot(registry)[("sift_demo_total", ())])
        except Exception as exc:
            failures.append(exc)

    merging = threading.Thread(target=merge_all)
    merging.start()
    while not merged.is_set():
        scrape()
    merging.join()
    scrape()
    assert failures == []
    assert seen == [200.0] * len(seen), sorted(set(seen))


# A merge run in a process of its own, SIGKILLed just before its ``die_at``-th change to the
# folder's files: a write into a value file, a rename or a removal (0: never).
MERGE_KILLED_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from prometheus_client.mmap_dict import MmapedDict
    from worker.observability import metrics

    directory, pid, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    steps = 0

    def step(change):
        def counted(*args, **kwargs):
            global steps
            steps += 1
            if steps == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return change(*args, **kwargs)
        return counted

    os.replace, os.rename, os.unlink = step(os.replace), step(os.rename), step(os.unlink)
    MmapedDict.write_value = step(MmapedDict.write_value)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    metrics.merge_dead_process(pid)
    print(steps)
    """
)


def _merge_killed_at(folder: Path, pid: int, die_at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", MERGE_KILLED_SCRIPT, str(folder), str(pid), str(die_at)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _totals(folder: Path) -> tuple[float, float, float]:
    """The counter, a histogram bucket and the histogram's sum, as a scrape exports them."""
    registry = CollectorRegistry()
    metrics.SweepingCollector(registry, path=str(folder))  # type: ignore[no-untyped-call]
    got = metrics.snapshot(registry)
    return (
        got[("sift_demo_total", ())],
        got[("sift_took_bucket", (("le", "1.0"),))],
        got[("sift_took_sum", ())],
    )


def test_a_merge_killed_at_any_step_never_counts_a_process_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor SIGKILLed inside a merge, after it had added a dead process's counts to
    the merged file and before it removed the process's own, left them in both: every scrape
    counted them twice (and one killed while writing the merged file left part of them
    there, to be added again). Killed before any one change to the files, a scrape still
    counts each process once: at once (the next scrape's sweep not run yet), once the sweep
    has finished the merge, after another merge, and after the supervisor starts again."""
    from worker.observability.metrics import _multiprocess

    live = os.getpid()
    earlier, killed, later = _dead_pids(3)
    true = (8.0, 8.0, 4.0)  # the live process's 5, the earlier's 1, the killed merge's 2
    restarted: list[Path] = []
    die_at = 0
    while True:
        die_at += 1
        folder = tmp_path / f"killed-at-{die_at}"
        folder.mkdir()
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
        for pid, count in ((live, 5.0), (earlier, 1.0), (killed, 2.0)):
            _write_process_files(folder, pid, count)
        metrics.merge_dead_process(earlier)  # so there is a merged file to add to
        run = _merge_killed_at(folder, killed, die_at)
        if run.returncode == 0:  # it made fewer changes than die_at: every step was tried
            assert die_at > 4, run.stdout  # the writes, the renames and the removals
            break
        assert run.returncode == -9, run.stderr
        restarted.append(shutil.copytree(folder, tmp_path / f"restarted-{die_at}"))
        with monkeypatch.context() as no_sweep:  # a scrape before any sweep sees the folder
            no_sweep.setattr(_multiprocess, "sweep_dead_processes", lambda _: [])
            assert _totals(folder) == true, die_at
        assert _totals(folder) == true, die_at  # its sweep finishes the merge
        assert _totals(folder) == true, die_at
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [f"counter_{live}.db", f"histogram_{live}.db", f"gauge_livesum_{live}.db",
             "counter_merged.db", "histogram_merged.db", ".merge.lock"]
        ), die_at  # fmt: skip
        _write_process_files(folder, later, 3.0)
        metrics.merge_dead_process(later)
        assert _totals(folder) == (11.0, 11.0, 5.5), die_at
    # The supervisor started again (setup_multiprocess) finds nothing of the merge left.
    code = "import sys\nfrom worker.observability import metrics\n"
    code += "for folder in sys.argv[1:]:\n    metrics.setup_multiprocess(folder)\n"
    restart = subprocess.run(
        [sys.executable, "-c", code, *map(str, restarted)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,  # its warning that this process's files are there
        text=True,
        timeout=60,
    )
    assert restart.returncode == 0, restart.stderr
    for folder in restarted:
        assert [p.name for p in folder.iterdir() if p.name != ".merge.lock"] == [], folder
