"""The dashboards' PromQL, the rules and ``sift cost`` against a real Prometheus.

A real ``prometheus`` scrapes a real ``/metrics`` endpoint every second. Behind it, a process
in multiprocess mode forks two workers that run scripted searches through the real
``SearchPipeline`` with the fakes of ``tests.fakes`` and ``PrometheusRecorder``; the fake
model's usage figures are known. Then every panel of both dashboards is evaluated through
Prometheus's HTTP API, and the totals are checked against what the workload did.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import metrics_workload as workload
from tests.prometheus_support import (
    DASHBOARDS,
    RATE_LIMITS_DASHBOARD,
    RULES,
    PanelQuery,
    Prometheus,
    assert_panel_has_data,
    concrete,
    dashboard_queries,
    requires_prometheus,
    scrape_target,
)
from worker.constants import INGEST_QUEUE, POLICY_ID, PROMETHEUS_JOB_WORKER, SEARCH_QUEUE

pytestmark = [
    pytest.mark.integration,
    requires_prometheus(),
]

JOB = PROMETHEUS_JOB_WORKER
PANEL_QUERIES = dashboard_queries(rate_limits=False)


@dataclass
class Observed:
    prometheus: Prometheus
    did: dict[str, Any]  # what the workload reports it did


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    workdir = tmp_path_factory.mktemp("prometheus")
    with scrape_target(workdir, JOB, ["tests.metrics_workload"], [RULES]) as (target, prometheus):
        prometheus.wait_for_scrapes(JOB, 3)  # the zero series are in, so rates have a start
        did = target.send("go")
        attempts = sum(workload.EXPECTED_ATTEMPTS.values())
        prometheus.wait_for_value("sum(sift_rerank_attempts_total)", attempts)
        prometheus.wait_for_more_scrapes(JOB, 2)
        yield Observed(prometheus, did)


def test_the_dashboards_have_panels() -> None:
    assert {path.name for path in DASHBOARDS} == {
        "sift-rerank-cost.json",
        "sift-jobs.json",
        RATE_LIMITS_DASHBOARD,
    }
    assert len(PANEL_QUERIES) >= 20


@pytest.mark.parametrize("query", PANEL_QUERIES, ids=str)
def test_every_panel_returns_data(observed: Observed, query: PanelQuery) -> None:
    assert_panel_has_data(observed.prometheus, query)


def test_token_totals_equal_the_fakes_usage_and_the_jobs_usage(observed: Observed) -> None:
    tokens = observed.prometheus.values("sum by (type) (sift_rerank_tokens_total)", by="type")
    fake, jobs = observed.did["fake_tokens"], observed.did["result_usage"]
    assert fake["input"] > 0 and fake["cache_read"] > 0 and fake["cache_creation"] > 0
    assert tokens == {token_type: float(n) for token_type, n in fake.items()}
    assert tokens == {
        "input": jobs["input_tokens"],
        "output": jobs["output_tokens"],
        "cache_read": jobs["cache_read_input_tokens"],
        "cache_creation": jobs["cache_creation_input_tokens"],
    }
    lanes = observed.prometheus.values("sum by (lane) (sift_rerank_tokens_total)", by="lane")
    assert set(lanes) == {"standard", "economy"} and all(lanes.values())
    economy = workload.usage(7)  # the economy lane's one answer
    assert lanes["economy"] == (
        economy.input_tokens
        + economy.output_tokens
        + economy.cache_read_input_tokens
        + economy.cache_creation_input_tokens
    )


def test_the_economy_lane_costs_half(observed: Observed) -> None:
    from worker.core.cost import cost_usd, price_for
    from worker.settings import DEFAULT_PRICES

    by_lane = observed.prometheus.values("sum by (lane) (sift_rerank_cost_usd_total)", by="lane")
    full = cost_usd(workload.usage(7), price_for(workload.MODEL, DEFAULT_PRICES))
    assert by_lane["economy"] == pytest.approx(full / 2, rel=1e-9)


def test_cost_total_equals_the_fakes_usage_priced_and_the_jobs_cost(observed: Observed) -> None:
    cost = observed.prometheus.values("sum(sift_rerank_cost_usd_total)")[""]
    assert cost > 0
    assert cost == pytest.approx(observed.did["fake_cost"], rel=1e-9)
    assert cost == pytest.approx(observed.did["result_cost"], rel=1e-9)
    by_model = observed.prometheus.values("sum by (model) (sift_rerank_cost_usd_total)", by="model")
    assert list(by_model) == [workload.MODEL]


def test_each_attempt_class_is_counted_exactly_as_often_as_provoked(observed: Observed) -> None:
    counted = observed.prometheus.values(
        "sum by (result) (sift_rerank_attempts_total)", by="result"
    )
    assert {k: v for k, v in counted.items() if v} == workload.EXPECTED_ATTEMPTS
    # every class provoked, but the rate budget's: the workload meters no limit, so its
    # series is the preregistered zero (tests/integration/test_rate_budget.py provokes it)
    assert set(counted) == set(workload.EXPECTED_ATTEMPTS) | {"budget_exhausted"}
    # by lane: the economy lane's one answer is its one attempt, every other is the standard's
    lanes = observed.prometheus.values("sum by (lane) (sift_rerank_attempts_total)", by="lane")
    total = sum(workload.EXPECTED_ATTEMPTS.values())
    assert lanes == {"standard": total - 1, "economy": 1}
    # the scripted rate_limited attempt came out of the model adapter: a 429, by lane
    answered_429 = observed.prometheus.values("sum by (lane) (sift_provider_429_total)", by="lane")
    assert answered_429 == {"standard": workload.EXPECTED_ATTEMPTS["rate_limited"], "economy": 0}


def test_attempts_sent_and_never_answered_are_counted_with_their_estimated_input(
    observed: Observed,
) -> None:
    """The timeout and the connections lost after their requests went out: the provider may
    have billed them, and no usage says so. Counted apart, with their prompts' estimated
    input tokens, by lane; nothing counted them before."""
    unread = observed.prometheus.values(
        "sum by (lane) (sift_rerank_unread_attempts_total)", by="lane"
    )
    assert unread == {"standard": workload.EXPECTED_UNREAD, "economy": 0.0}
    assert observed.did["fake_unread"] == workload.EXPECTED_UNREAD
    tokens = observed.prometheus.values("sum(sift_rerank_unread_input_tokens_total)")[""]
    assert tokens == observed.did["fake_unread_input"] > 0


def test_each_outcome_is_counted_exactly_as_often_as_provoked(observed: Observed) -> None:
    counted = observed.prometheus.values(
        f'sum by (outcome) (sift_rerank_outcomes_total{{policy="{POLICY_ID}"}})', by="outcome"
    )
    assert counted == workload.EXPECTED_OUTCOMES
    searches = observed.prometheus.query(
        "sum by (mode, outcome) (sift_search_duration_seconds_count) > 0"
    )
    got = {(s["metric"]["mode"], s["metric"]["outcome"]): float(s["value"][1]) for s in searches}
    assert got == workload.EXPECTED_SEARCHES
    rerank_done = observed.prometheus.values("sum(sift_rerank_duration_seconds_count)")[""]
    reranked = sum(v for k, v in workload.EXPECTED_OUTCOMES.items() if k != "skipped")
    assert rerank_done == reranked


def test_job_metrics(observed: Observed) -> None:
    p = observed.prometheus
    searches = sum(workload.EXPECTED_SEARCHES.values())
    assert observed.did["exit_codes"] == [0, 0, 0]
    assert p.values('sift_jobs_submitted_total{kind="search"}')[""] == searches
    completed = p.values('sum by (status) (sift_jobs_completed_total{kind="search"})', by="status")
    assert completed == {"succeeded": searches - 1, "failed": 1, "canceled": 0}
    failures = p.query("sift_job_failures_total > 0")  # every other class is a zero series
    assert [(s["metric"]["error"], s["value"][1]) for s in failures] == [("rerank_failed", "1")]
    assert observed.did["statuses"] == {"succeeded": searches - 1, "failed:rerank_failed": 1}
    assert p.values('sift_webhook_deliveries_total{result="delivered"}')[""] == searches - 1
    wait = p.values("sum by (queue) (sift_job_queue_wait_seconds_count)", by="queue")
    assert wait[SEARCH_QUEUE] == searches and wait[INGEST_QUEUE] == 0
    backlog = p.values("sift_queue_backlog", by="queue")
    assert backlog == {q: float(n) for q, n in observed.did["backlog"].items()}
    # the workers exited and were marked dead: nothing is left in flight
    assert p.values("sum(sift_jobs_in_flight)")[""] == 0
    assert p.values("sum(sift_rerank_in_flight)")[""] == 0


def test_recording_rules_evaluate_on_real_data(observed: Observed) -> None:
    p = observed.prometheus
    for record in (
        "sift:rerank_cost_usd:rate1h",
        "sift:rerank_cost_usd_per_1k_searches:rate1h",
        "sift:rerank_attempt_error_ratio:rate5m",
        "sift:rerank_fallback_ratio:rate5m",
        "sift:rerank_unread_ratio:rate5m",
    ):
        p.wait_for_value(f"count({record}) > bool 0", 1)  # one series per lane, or more
    # 11 of 17 attempts were not ok, the refusal among them; within the 5m window, all counted
    ratio = p.values("sift:rerank_attempt_error_ratio:rate5m")[""]
    assert ratio == pytest.approx(11 / 17, rel=1e-6)
    # of the same 17 sent, those whose answer was never read (SiftRerankUnreadAttemptsHigh's)
    unread = p.values("sift:rerank_unread_ratio:rate5m")[""]
    assert unread == pytest.approx(workload.EXPECTED_UNREAD / 17, rel=1e-6)


def test_sift_cost_reads_the_same_totals(observed: Observed, tmp_path: Path) -> None:
    from worker.cli.cost import fetch_report

    report = fetch_report(observed.prometheus.url, "1h")
    assert report.cost_by_model == {
        workload.MODEL: pytest.approx(observed.did["fake_cost"], rel=1e-9)
    }
    # and by lane: the economy lane's one answer at half its price, the standard lane the rest
    from worker.core.cost import cost_usd, price_for
    from worker.settings import DEFAULT_PRICES

    economy = cost_usd(workload.usage(7), price_for(workload.MODEL, DEFAULT_PRICES))
    assert economy is not None
    assert report.cost_by_lane == {
        "economy": pytest.approx(economy / 2, rel=1e-9),
        "standard": pytest.approx(observed.did["fake_cost"] - economy / 2, rel=1e-9),
    }
    assert report.tokens_by_type == {k: float(v) for k, v in observed.did["fake_tokens"].items()}
    assert {k: v for k, v in report.attempts.items() if v} == workload.EXPECTED_ATTEMPTS
    assert report.outcomes == workload.EXPECTED_OUTCOMES
    assert report.searches == sum(workload.EXPECTED_SEARCHES.values())
    # one set of percentiles per lane: the economy lane's minutes must not hide the standard's
    assert set(report.latency) == {"standard", "economy"}
    assert all(report.latency[lane]["p50"] is not None for lane in report.latency)
    assert report.unpriced_calls == 0  # the workload's model has a price
    assert report.unread_attempts == workload.EXPECTED_UNREAD
    assert report.unread_input_tokens == observed.did["fake_unread_input"]
    # their input at the model's input price (all in the standard lane): an estimate in USD
    haiku = price_for(workload.MODEL, DEFAULT_PRICES)
    assert haiku is not None and report.unread_unpriced_tokens == 0
    assert report.unread_input_cost == pytest.approx(
        observed.did["fake_unread_input"] * haiku.input / 1_000_000, rel=1e-9
    )


def test_sift_cost_prints_a_table_and_writes_a_png(observed: Observed, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    import worker.cli.cost  # noqa: F401  # registers the command
    from worker.cli import app

    png = tmp_path / "cost.png"
    run = CliRunner().invoke(
        app,
        ["cost", "--prometheus-url", observed.prometheus.url, "--window", "1h", "--png", str(png)],
        env={"COLUMNS": "160"},
    )
    assert run.exit_code == 0, run.output
    assert workload.MODEL in run.output
    for word in ("cache_read", "fallback_no_valid_ranks", "rate_limited", "p95", "economy lane"):
        assert word in run.output
    unread = f"possibly billed, not read: {workload.EXPECTED_UNREAD} attempts"
    assert unread in " ".join(run.output.split()), run.output
    assert "USD at the input price (an estimate" in " ".join(run.output.split()), run.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def _panel(title: str, ref_id: str = "A") -> str:
    """The concrete PromQL of the cost dashboard's panel ``title``."""
    [query] = [
        q for q in PANEL_QUERIES
        if q.dashboard == "sift-rerank-cost" and q.panel == title and q.ref_id == ref_id
    ]  # fmt: skip
    return concrete(query.expr)


def test_the_cost_panels_show_the_spend_and_the_cost_per_1k_searches(observed: Observed) -> None:
    # what each stat's title says, against what the workload did: its model's usage priced
    p, spent = observed.prometheus, observed.did["fake_cost"]
    searches = sum(workload.EXPECTED_SEARCHES.values())
    per_1k = p.values(_panel("Dollars per 1,000 searches in range"))[""]
    assert per_1k == pytest.approx(1000 * spent / searches, rel=1e-9)
    # increase() extrapolates from the last sample to the range's end: at the instant of a
    # scrape there is nothing to extrapolate (nor before a series that starts at zero)
    [last] = p.query("max(timestamp(sift_rerank_cost_usd_total))")
    at = float(last["value"][1])
    response = p.client.get(
        f"{p.url}/api/v1/query", params={"query": _panel("Spend in range (USD)"), "time": at}
    )
    [shown] = response.json()["data"]["result"]
    assert float(shown["value"][1]) == pytest.approx(spent, rel=1e-9)


def test_the_latency_panel_shows_the_quantiles_of_what_was_observed(observed: Observed) -> None:
    # the economy lane's one rerank took 1.0 s (scripted), in the (0.75, 1.0] bucket: each
    # quantile is interpolated in it, as Prometheus does with one observation
    title = "Rerank latency by outcome (p50, p95, p99)"
    for ref_id, q in (("A", 0.5), ("B", 0.95), ("C", 0.99)):
        shown = observed.prometheus.query(_panel(title, ref_id))
        economy = [float(s["value"][1]) for s in shown if s["metric"]["lane"] == "economy"]
        assert economy == [pytest.approx(0.75 + 0.25 * q)], (ref_id, shown)
