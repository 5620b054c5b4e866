"""The dashboards and the recording rules on an idle stack, against a real Prometheus.

A real ``prometheus`` scrapes a real ``/metrics`` every second: the metrics target of
``tests.metrics_workload`` in multiprocess mode, its series pre-registered at zero as a worker's
are at start-up, and no traffic at all. A panel may then show no data, or zero; never NaN or
an infinity (a ratio dividing by zero searches, a percentile of no observations), which Grafana
shows as ``NaN`` in a stat panel and in a legend.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.prometheus_support import (
    DASHBOARDS,
    RULES,
    PanelQuery,
    Prometheus,
    concrete,
    panel_queries,
    requires_prometheus,
    scrape_target,
)
from worker.constants import PROMETHEUS_JOB_WORKER

pytestmark = [
    pytest.mark.integration,
    requires_prometheus(),
]

JOB = PROMETHEUS_JOB_WORKER
PANEL_QUERIES = [query for path in DASHBOARDS for query in panel_queries(path)]
RECORDED = [
    rule["record"]
    for group in yaml.safe_load(RULES.read_text())["groups"]
    for rule in group["rules"]
    if "record" in rule
]


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    workdir = tmp_path_factory.mktemp("prometheus-idle")
    with scrape_target(workdir, JOB, ["tests.metrics_workload"], [RULES]) as (_, prometheus):
        prometheus.wait_for_scrapes(JOB, 5)  # enough samples in a 1m window for every rate()
        yield prometheus


def finite_or_absent(prometheus: Prometheus, expr: str) -> list[str]:
    """The series of ``expr`` whose value is NaN or infinite, described."""
    return [
        f"{series['metric']} = {series['value'][1]}"
        for series in prometheus.query(expr)
        if not math.isfinite(float(series["value"][1]))
    ]


def test_the_idle_stack_has_its_zero_series(idle: Prometheus) -> None:
    """So the checks below see real, zero-valued inputs, not an empty TSDB."""
    assert idle.values("sum(sift_rerank_cost_usd_total)") == {"": 0.0}
    assert idle.values("count(sift_rerank_duration_seconds_bucket)")[""] > 0


@pytest.mark.parametrize("query", PANEL_QUERIES, ids=str)
def test_no_panel_shows_nan_on_an_idle_stack(idle: Prometheus, query: PanelQuery) -> None:
    assert finite_or_absent(idle, concrete(query.expr)) == [], query.expr


@pytest.mark.parametrize("record", RECORDED)
def test_no_recording_rule_records_nan_on_an_idle_stack(idle: Prometheus, record: str) -> None:
    assert finite_or_absent(idle, record) == []


def test_every_panel_and_rule_was_checked() -> None:
    assert len(PANEL_QUERIES) > 20 and len(RECORDED) >= 5
    assert {Path(p).name for p in DASHBOARDS} >= {"sift-rerank-cost.json", "sift-jobs.json"}
