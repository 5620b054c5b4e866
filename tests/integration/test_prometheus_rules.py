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
