"""The Grafana dashboards: stable uids, a fixed datasource, Sift's metrics, known variables."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.prometheus_support import DASHBOARDS, ROOT, concrete, panel_queries, panels
from worker import constants

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
UIDS = {
    "sift-rerank-cost.json": "sift-rerank-cost",
    "sift-jobs.json": "sift-jobs",
    "sift-rate-limits.json": "sift-rate-limits",
}
METRIC_NAMES = {v for k, v in vars(constants).items() if k.startswith("METRIC_")}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_provisionable(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] == UIDS[path.name]
    assert "id" not in dashboard  # provisioning assigns it
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"] == DATASOURCE, panel["title"]
    assert "${DS_PROMETHEUS}" not in path.read_text()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_use_only_sifts_metrics_and_known_variables(path: Path) -> None:
    for query in panel_queries(path):
        expr = concrete(query.expr)  # raises on an unknown Grafana variable
        names = set(re.findall(r"\b(sift_[a-z0-9_]+)", expr))
        bases = {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}
        assert bases <= METRIC_NAMES, f"{query}: {bases - METRIC_NAMES}"


def test_the_provisioned_datasource_has_the_dashboards_uid() -> None:
    text = (ROOT / "grafana" / "provisioning" / "datasources.yml").read_text()
    assert "uid: prometheus" in text and "type: prometheus" in text


def test_the_issues_panels_are_all_there() -> None:
    titles = {
        path.name: " | ".join(p["title"] for p in panels(json.loads(path.read_text())))
        for path in DASHBOARDS
    }
    rerank = [
        "p50, p95, p99",
        "Tokens per second by type",
        "Dollars per hour",
        "per 1,000 searches",
        "attempts per second by result class",
        "Fallback and failure rates",
        "Reranks in flight",
    ]
    jobs = [
        "submitted per second",
        "completed per second",
        "Queue wait",
        "Search duration by mode and outcome",
        "failures per second by class",
        "Webhook deliveries per second by result",
        "Queue backlog",
        "Workers",
    ]
    limits = ["Budget wait by lane (p50, p95)", "429 answers per minute"]
    assert all(words in titles["sift-rerank-cost.json"] for words in rerank)
    assert all(words in titles["sift-jobs.json"] for words in jobs)
    assert all(words in titles["sift-rate-limits.json"] for words in limits)
