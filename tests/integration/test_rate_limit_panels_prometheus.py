"""The rate-limits dashboard's PromQL against a real Prometheus, on a real rate-limited run.

A real ``prometheus`` scrapes ``/metrics`` of ``tests.rate_limit_workload`` every second. The
workload sends real searches through the real SDK to the fake Messages API, limited to
``RPM`` requests a minute: first a flood with no rate budget (answered 429 beyond the fake's
bucket), then searches drawing on the shared budget in a real redis-server, which wait for it.
Every panel of ``grafana/sift-rate-limits.json`` must then answer, and the 429 and wait
series must equal what the fake and the searches' traces say happened.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests import fake_anthropic as fa
from tests.prometheus_support import (
    PanelQuery,
    Prometheus,
    assert_panel_has_data,
    concrete,
    dashboard_queries,
    requires_prometheus,
    scrape_target,
)
from worker.constants import PROMETHEUS_JOB_WORKER

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    requires_prometheus(),
]

JOB = PROMETHEUS_JOB_WORKER
RPM = 60  # one request a second: the flood empties the bucket, the budget then waits
FLOOD, METERED = 80, 12
PANEL_QUERIES = dashboard_queries(rate_limits=True)


@dataclass
class Observed:
    prometheus: Prometheus
    flood: dict[str, Any]
    metered: dict[str, Any]
    answered_429: int  # what the fake counted
    at_once: dict[str, Any]  # a first metered search, before the flood
    median_at_once: float  # the wait's median after it alone


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Observed]:
    workdir = tmp_path_factory.mktemp("prometheus-limits")
    with fa.FakeAnthropic(rpm=RPM) as fake:
        workload = ["tests.rate_limit_workload", redis_url, fake.url, str(RPM)]
        with scrape_target(workdir, JOB, workload) as (target, prometheus):
            prometheus.wait_for_scrapes(JOB, 3)  # the zero series are in, so rates have a start
            at_once = target.send("metered 1")  # the budget is full: sent without a wait
            prometheus.wait_for_value("sum(sift_rate_budget_wait_seconds_count)", 1)
            median = prometheus.values(
                "histogram_quantile(0.5, sum by (le) (sift_rate_budget_wait_seconds_bucket))"
            )[""]
            flood = target.send(f"flood {FLOOD}")
            metered = target.send(f"metered {METERED}")
            metered = {key: metered[key] + at_once[key] for key in ("sent", "waited")}
            answered_429 = fake.rate_limited()
            prometheus.wait_for_value("sum(sift_provider_429_total)", answered_429)
            prometheus.wait_for_value("sum(sift_rate_budget_wait_seconds_count)", metered["sent"])
            prometheus.wait_for_more_scrapes(JOB, 2)
            yield Observed(prometheus, flood, metered, answered_429, at_once, median)


def test_the_dashboard_has_the_issues_panels() -> None:
    titles = {query.panel for query in PANEL_QUERIES}
    assert "Budget wait by lane (p50, p95)" in titles
    assert "429 answers per minute by lane" in titles


@pytest.mark.parametrize("query", PANEL_QUERIES, ids=str)
def test_every_panel_returns_data(observed: Observed, query: PanelQuery) -> None:
    assert_panel_has_data(observed.prometheus, query)


def test_the_429_series_counts_every_429_the_provider_sent(observed: Observed) -> None:
    assert observed.answered_429 > 0  # the flood went past the fake's bucket
    by_lane = observed.prometheus.values("sum by (lane) (sift_provider_429_total)", by="lane")
    assert by_lane == {"standard": observed.answered_429, "economy": 0}
    per_minute = observed.prometheus.values(
        concrete("sum by (lane) (rate(sift_provider_429_total[$__rate_interval])) * 60"), by="lane"
    )
    assert per_minute["standard"] > 0


def test_a_wait_s_quantiles_read_zero_while_no_call_waited(observed: Observed) -> None:
    """A call sent at once waited 0 s, not the half of the first bucket (0.5 ms) Prometheus
    interpolates to when that bucket's lower bound is not a bucket of its own."""
    assert observed.at_once == {"sent": 1, "waited": 0}
    assert observed.median_at_once == 0.0


def test_the_wait_series_counts_every_metered_call_and_shows_the_wait(observed: Observed) -> None:
    p = observed.prometheus
    counted = p.values("sum by (lane) (sift_rate_budget_wait_seconds_count)", by="lane")
    assert counted == {"standard": observed.metered["sent"], "economy": 0}
    # the flood emptied the provider's bucket: the metered searches waited for the budget
    assert observed.metered["waited"] > 0
    at_once = p.values('sum(sift_rate_budget_wait_seconds_bucket{le="0.001"})')[""]
    assert at_once == observed.metered["sent"] - observed.metered["waited"]
    p95 = p.values(
        concrete(
            "histogram_quantile(0.95, sum by (le, lane) "
            "(rate(sift_rate_budget_wait_seconds_bucket[$__rate_interval])))"
        ),
        by="lane",
    )
    assert p95["standard"] > 0
