"""The Prometheus rules pass ``promtool check rules`` and their ``promtool test rules`` tests."""

from __future__ import annotations

import subprocess

import pytest

from tests.prometheus_support import ROOT, RULES, promtool_binary, requires_prometheus

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
