"""``sift cost`` without Prometheus: exact counter increases, and a clear error when unreachable."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner, Result

import worker.cli.cost as cost
from tests.prometheus_support import free_port
from worker.cli import app
from worker.errors import SiftError
from worker.prices import Price


def test_counter_increase_is_exact_and_survives_resets() -> None:
    assert cost.counter_increase([]) == 0
    assert cost.counter_increase([4.0]) == 0
    assert cost.counter_increase([0.0, 1.5, 1.5, 4.0]) == 4.0
    assert cost.counter_increase([10.0, 12.0, 3.0, 5.0]) == 2.0 + 3.0 + 2.0


def test_cost_per_thousand_searches() -> None:
    report = cost.CostReport("1h", {"m": 0.5, "n": 0.25}, {}, {}, {}, 250, {})
    assert report.total_cost == 0.75
    assert report.cost_per_1k_searches == 3.0
    assert cost.CostReport("1h", {}, {}, {}, {}, 0, {}).cost_per_1k_searches is None


def test_an_unreachable_prometheus_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run = CliRunner().invoke(app, ["cost", "--prometheus-url", url], env={"COLUMNS": "160"})
    assert run.exit_code == 1
    assert "did not answer" in run.output and url in run.output


def test_an_unreachable_prometheus_names_where_its_url_is_set() -> None:
    """A newcomer's ``sift cost`` with no Prometheus at the default URL: the error names the
    option and the setting to point it elsewhere (it named the URL alone)."""
    url = f"http://127.0.0.1:{free_port()}"
    env = {"COLUMNS": "200", "SIFT_PROMETHEUS_URL": url}
    run = CliRunner().invoke(app, ["cost"], env=env)
    assert run.exit_code == 1
    printed = " ".join(run.output.split())
    assert f"Prometheus at {url} (--prometheus-url, SIFT_PROMETHEUS_URL) did not answer" in printed


@pytest.mark.parametrize("url", ["127.0.0.1:9090", "ftp://prometheus", "http://", ""])
def test_a_prometheus_url_that_is_no_http_url_names_the_option(url: str) -> None:
    """``--prometheus-url`` sets SIFT_PROMETHEUS_URL and is checked as it is, a usage error
    naming the option, exit 2: it was sent as it was, and the HTTP client's complaint came
    back as Prometheus not answering, exit 1."""
    run = CliRunner().invoke(app, ["cost", "--prometheus-url", url], env={"COLUMNS": "200"})
    assert run.exit_code == 2, run.output
    printed = " ".join(run.output.split())
    assert "Invalid value for '--prometheus-url': must be http:// or https://" in printed, printed
    assert "did not answer" not in printed


def test_the_help_names_the_setting_the_url_defaults_to() -> None:
    """The help said ``[default: SIFT_PROMETHEUS_URL]``, which rich took for markup and left
    out: ``--prometheus-url`` showed no default at all."""
    run = CliRunner().invoke(app, ["cost", "--help"], env={"COLUMNS": "200"})
    assert run.exit_code == 0
    assert "SIFT_PROMETHEUS_URL" in run.output, run.output


def test_the_window_is_an_hour_or_a_day() -> None:
    run = CliRunner().invoke(app, ["cost", "--window", "1w"])
    assert run.exit_code == 2


def _printed(report: cost.CostReport) -> str:
    console = Console(width=160, record=True)
    for item in cost.render(report, "http://prometheus"):
        console.print(item)
    return console.export_text()


def test_unpriced_calls_are_reported_beside_the_cost_they_leave_out() -> None:
    """Calls to a model with no price add nothing to the cost counter: the report must say
    its dollars are too low, not print them as the whole bill."""
    report = cost.CostReport("1h", {"m": 0.5}, {}, {}, {}, 10, {}, unpriced_calls=7)
    out = _printed(report)
    assert "7 model calls" in out and "SIFT_PRICES" in out and "too low" in out
    priced = cost.CostReport("1h", {"m": 0.5}, {}, {}, {}, 10, {})
    assert "warning" not in _printed(priced)


HAIKU = Price(input=1.0, output=5.0, cache_read=0.1, cache_creation=1.25)


def test_unread_input_is_priced_at_each_model_s_input_price_the_economy_lane_at_half() -> None:
    """Each (model, lane)'s estimated unread input at its model's input price (a dated
    snapshot at its alias's); the economy lane's at the Message Batches discount; a model
    with no price adds no dollars, its tokens given apart."""
    tokens = {
        ("claude-haiku-4-5", "standard"): 2_000_000.0,
        ("claude-haiku-4-5-20251001", "standard"): 1_000_000.0,
        ("claude-haiku-4-5", "economy"): 2_000_000.0,
        ("claude-new-model", "standard"): 7_000.0,
    }
    assert cost.unread_input_cost(tokens, {"claude-haiku-4-5": HAIKU}) == (4.0, 7_000.0)
    assert cost.unread_input_cost({}, {"claude-haiku-4-5": HAIKU}) == (0.0, 0.0)


def test_unread_attempts_are_reported_with_their_estimated_dollars() -> None:
    """The possibly billed, not read line gives the dollars of their input as an estimate (it
    gave tokens alone), and says when some of them were to a model with no price."""
    report = cost.CostReport(
        "1h", {"m": 0.5}, {}, {}, {}, 10, {}, unread_attempts=3, unread_input_tokens=3900,
        unread_input_cost=0.0039,
    )  # fmt: skip
    said = " ".join(_printed(report).split())
    assert "possibly billed, not read: 3 attempts" in said, said
    assert "about 3,900 input tokens by estimate, about 0.003900 USD at the input price" in said
    assert "no price" not in said
    unpriced = cost.CostReport(
        "1h", {"m": 0.5}, {}, {}, {}, 10, {}, unread_attempts=3, unread_input_tokens=3900,
        unread_input_cost=0.0039, unread_unpriced_tokens=900,
    )  # fmt: skip
    said = " ".join(_printed(unpriced).split())
    assert "900 of those tokens, to a model with no price in SIFT_PRICES, are not in" in said


def test_the_chart_s_title_gives_the_unread_attempts_estimate() -> None:
    """``--png`` titles its chart with the cost and what it leaves out (unpriced calls); the
    unread attempts' estimate is one of those."""
    read = cost.CostReport("1h", {"m": 0.5}, {}, {}, {}, 10, {})
    assert "not read" not in cost.chart_title(read)
    unread = cost.CostReport(
        "1h", {"m": 0.5}, {}, {}, {}, 10, {}, unread_attempts=3, unread_input_tokens=3900,
        unread_input_cost=0.0039,
    )  # fmt: skip
    title = cost.chart_title(unread)
    assert title.startswith("Sift rerank, last 1h: 0.5000 USD")
    assert "possibly billed, not read: 3 attempts, about 0.0039 USD of input (estimate)" in title


def test_latency_is_shown_per_lane() -> None:
    latency: dict[str, dict[str, float | None]] = {
        "standard": {"p50": 1.25, "p95": 2.5, "p99": 3.0},
        "economy": {"p50": 600.0, "p95": None, "p99": None},
    }
    out = _printed(cost.CostReport("1h", {}, {}, {}, {}, 0, latency))
    standard = next(line for line in out.splitlines() if "standard" in line)
    economy = next(line for line in out.splitlines() if "economy" in line)
    assert "1.250" in standard and "3.000" in standard and "600.000" in economy


def test_json_prints_the_whole_report(monkeypatch: pytest.MonkeyPatch) -> None:
    latency: dict[str, dict[str, float | None]] = {"standard": {"p50": 1.25, "p95": None}}
    report = cost.CostReport(
        "1d", {"m": 0.5, "n": 0.25}, {"input": 700.0}, {"applied": 3.0}, {"ok": 4.0}, 250,
        latency, unpriced_calls=2, cost_by_lane={"standard": 0.5, "economy": 0.25},
        unread_attempts=3, unread_input_tokens=3900, unread_input_cost=0.0039,
    )  # fmt: skip
    asked: list[tuple[str, str, Mapping[str, Price]]] = []

    def fetch(url: str, window: str, prices: Mapping[str, Price]) -> cost.CostReport:
        asked.append((url, window, prices))
        return report

    monkeypatch.setattr(cost, "fetch_report", fetch)
    url = "http://prometheus:9090"
    args = ["cost", "--prometheus-url", url, "--window", "1d", "--json"]
    priced = '{"m": {"input": 2, "output": 10, "cache_read": 0.2, "cache_creation": 2.5}}'
    run = CliRunner().invoke(app, args, env={"COLUMNS": "80", "SIFT_PRICES": priced})
    assert run.exit_code == 0, run.output
    assert [(u, w) for u, w, _ in asked] == [(url, "1d")]
    assert asked[0][2]["m"].input == 2.0  # SIFT_PRICES prices the unread input
    assert json.loads(run.output) == {
        "prometheus_url": url,
        "window": "1d",
        "cost_by_model": {"m": 0.5, "n": 0.25},
        "tokens_by_type": {"input": 700.0},
        "outcomes": {"applied": 3.0},
        "attempts": {"ok": 4.0},
        "searches": 250,
        "latency": {"standard": {"p50": 1.25, "p95": None}},
        "unpriced_calls": 2,
        "cost_by_lane": {"standard": 0.5, "economy": 0.25},
        "unread_attempts": 3,
        "unread_input_tokens": 3900,
        "unread_input_cost": 0.0039,
        "unread_unpriced_tokens": 0,
        "total_cost": 0.75,
        "cost_per_1k_searches": 3.0,
    }


def test_one_search_is_counted_in_the_singular() -> None:
    assert "(1 search)" in _printed(cost.CostReport("1h", {"m": 0.5}, {}, {}, {}, 1, {}))
    assert "(2 searches)" in _printed(cost.CostReport("1h", {"m": 0.5}, {}, {}, {}, 2, {}))


def _cost_with_png(monkeypatch: pytest.MonkeyPatch, png: Path) -> tuple[Result, list[str]]:
    """``sift cost --png PNG`` on a report made here; answers the run and the windows read."""
    asked: list[str] = []

    def fetch(url: str, window: str, prices: Mapping[str, Price]) -> cost.CostReport:
        asked.append(window)
        return cost.CostReport("1h", {"m": 0.5}, {"input": 7.0}, {}, {}, 2, {})

    monkeypatch.setattr(cost, "fetch_report", fetch)
    args = ["cost", "--prometheus-url", "http://prometheus:9090", "--png", str(png)]
    return CliRunner().invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1"}), asked


@pytest.mark.parametrize("where", ["no-such-folder/c.png", "a-file/c.png"])
def test_a_png_it_cannot_write_is_refused_before_any_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    """``--png`` into a folder that is not there (or under a file) is one error line and exit
    1 before Prometheus is read: the whole report was printed first, then the error, so a
    ``sift cost --png x > report.txt`` left a report that looked done from a failed run."""
    (tmp_path / "a-file").write_text("")
    png = tmp_path / where
    run, asked = _cost_with_png(monkeypatch, png)
    assert isinstance(run.exception, SystemExit) and run.exit_code == 1, run.output
    assert run.stdout == "" and asked == [], run.output
    said = " ".join(run.stderr.split())
    assert f"error: --png: cannot write {png}" in said and "nothing was read" in said, said
    assert not (tmp_path / "no-such-folder").exists()
    # the same folder there: the report, then the chart
    png = tmp_path / "c.png"
    run, asked = _cost_with_png(monkeypatch, png)
    assert run.exit_code == 0, run.output
    assert "Rerank cost, last 1h" in run.stdout and png.read_bytes()[:4] == b"\x89PNG"


def test_a_folder_is_no_png_to_write(tmp_path: Path) -> None:
    """An existing folder passed :func:`check_png` (its parent is writable). The command's
    option refuses it before (``dir_okay=False``, a usage error); the check does too now."""
    with pytest.raises(SiftError, match=r"cannot write .* \(it is a folder\); nothing was read"):
        cost.check_png(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only file")
def test_an_existing_png_it_cannot_write_is_refused_before_any_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An existing read-only file passed the check (its folder is writable), then the report
    was printed and the chart failed; it is refused first now, and left as it was."""
    png = tmp_path / "c.png"
    png.write_bytes(b"kept")
    png.chmod(0o444)
    run, asked = _cost_with_png(monkeypatch, png)
    assert isinstance(run.exception, SystemExit) and run.exit_code == 1, run.output
    assert run.stdout == "" and asked == [], run.output
    said = " ".join(run.stderr.split())
    assert f"error: --png: cannot write {png} (Permission denied)" in said, said
    assert png.read_bytes() == b"kept"


def test_a_png_without_matplotlib_is_refused_before_any_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without ``sift[charts]`` installed, ``--png`` printed the report, then a traceback of
    the chart's SiftError (caught only around Prometheus's reads), exit 1 by accident."""
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    run, asked = _cost_with_png(monkeypatch, tmp_path / "c.png")
    assert isinstance(run.exception, SystemExit) and run.exit_code == 1, run.output
    assert run.stdout == "" and asked == [], run.output
    said = " ".join(run.stderr.split())
    assert "error: --png needs matplotlib: pip install 'sift[charts]'" in said, said
    assert not (tmp_path / "c.png").exists()
