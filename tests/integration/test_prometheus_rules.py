"""The Prometheus rules pass ``promtool check rules`` and their ``promtool test rules`` tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.prometheus_support import (
    ROOT,
    RULES,
    concrete,
    dashboard_queries,
    promtool_binary,
    requires_prometheus,
)

pytestmark = pytest.mark.integration

PROMTOOL = promtool_binary()
needs_promtool = requires_prometheus(promtool=True)
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "sift_test.yml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
def test_rules_are_valid() -> None:
    run = promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


@needs_promtool
def test_rule_unit_tests_pass() -> None:
    run = promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_rule_file_has_unit_tests() -> None:
    rule_files = sorted(p.name for p in RULES.parent.glob("*.yml"))
    tested = RULE_TESTS.read_text()
    assert rule_files == ["sift.yml"] and "../rules/sift.yml" in tested


# 15 calls a minute answered, 1 failed, 20 never sent (budget_exhausted: the shared rate
# budget could not admit them before their deadline): 1 of the 16 calls sent is an error.
NEVER_SENT_SERIES = {"ok": "0+15x60", "http_5xx": "0+1x60", "budget_exhausted": "0+20x60"}


@needs_promtool
def test_the_attempt_error_panel_leaves_out_calls_never_sent(tmp_path: Path) -> None:
    """The dashboard's "attempt errors" line is the recording rule's ratio: a call the rate
    budget never sent is no model error (it has its own panel on sift-rate-limits)."""
    (panel,) = [
        q
        for q in dashboard_queries(rate_limits=False)
        if q.panel == "Fallback and failure rates" and q.ref_id == "C"
    ]
    expr = concrete(panel.expr, {"__rate_interval": "5m"})
    labels = 'job="sift-worker",instance="w1",model="claude-haiku-4-5",lane="standard"'
    series = [
        {"series": f"sift_rerank_attempts_total{{{labels},result={json.dumps(result)}}}",
         "values": values}
        for result, values in NEVER_SENT_SERIES.items()
    ]  # fmt: skip
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {"expr": expr, "eval_time": "40m", "exp_samples": [{"labels": "{}",
                                                                        "value": 0.0625}]},
                    {"expr": "sift:rerank_attempt_error_ratio:rate5m", "eval_time": "40m",
                     "exp_samples": [{"labels": 'sift:rerank_attempt_error_ratio:rate5m'
                                                '{model="claude-haiku-4-5"}', "value": 0.0625}]},
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "panel_test.yml"
    path.write_text(yaml.safe_dump(tests))
    run = promtool("test", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr


def _stat_expr(title: str) -> str:
    """The one query of the sift-rerank-cost dashboard's stat panel ``title``."""
    dashboard = json.loads((ROOT / "grafana" / "sift-rerank-cost.json").read_text())
    (panel,) = [p for p in dashboard["panels"] if p["type"] == "stat" and p["title"] == title]
    (target,) = panel["targets"]
    return concrete(str(target["expr"]))  # $__range: 1h, $__rate_interval: 1m


@needs_promtool
def test_the_cost_per_1k_searches_stat_agrees_with_the_spend_in_range(tmp_path: Path) -> None:
    """The top row's per-1,000-searches figure is the range's spend over the range's
    searches, as ``sift cost`` reports it for a window: a reranked batch (16 minutes, $1.00,
    160 searches) then 15 minutes of searches without rerank (150). Read over the last
    minute, it said $0.00 beside a spend of $1.00 (and "No data" once searches stopped).
    The steps are exact binary fractions: a sum that rounds down reads as a counter reset."""
    spend = _stat_expr("Spend in range (USD)")
    per_1k = _stat_expr("Dollars per 1,000 searches in range")
    labels = 'job="sift-worker",instance="w1"'
    series = [
        {"series": f'sift_rerank_cost_usd_total{{{labels},model="claude-haiku-4-5",'
                   'lane="standard"}', "values": "0+0x10 0.0625+0.0625x15 1+0x14"},
        {"series": f'sift_search_duration_seconds_count{{{labels},mode="hybrid",'
                   'outcome="ok"}', "values": "0+0x10 10+10x15 170+10x14"},
    ]  # fmt: skip
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {"expr": spend, "eval_time": "41m",
                     "exp_samples": [{"labels": "{}", "value": 1.0}]},
                    {"expr": per_1k, "eval_time": "41m",
                     "exp_samples": [{"labels": "{}", "value": 1000 / 310}]},
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "stat_test.yml"
    path.write_text(yaml.safe_dump(tests))
    run = promtool("test", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr
