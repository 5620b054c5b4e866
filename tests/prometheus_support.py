"""Test helpers for a real Prometheus: start one, wait for scrapes, query it, read dashboards.

    with run_prometheus(tmp_path, {"sift-worker": ["127.0.0.1:9808"]}) as prometheus:
        prometheus.wait_for_scrapes("sift-worker", 2)
        prometheus.query('sum(sift_rerank_cost_usd_total)')

Every process started here is terminated and waited for, and every file handle closed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from worker.processes.stack import free_port

__all__ = ["free_port"]  # the one test modules import from here

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "grafana").glob("*.json"))
# Its panels need a rate-limited model and the shared budget in Redis, so only
# tests/integration/test_rate_limit_panels_prometheus.py can give them data.
RATE_LIMITS_DASHBOARD = "sift-rate-limits.json"
RULES = ROOT / "deploy" / "prometheus" / "rules" / "sift.yml"
READY_SECONDS = 60.0  # generous: only ever a bound on waiting for readiness

# What Grafana would put in place of its variables, for evaluating a panel outside Grafana.
GRAFANA_VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "__range_s": "3600",
}


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def promtool_binary() -> str | None:
    return shutil.which("promtool")


def requires_prometheus(*, promtool: bool = False) -> pytest.MarkDecorator:
    """Skip a module's tests where no ``prometheus`` (or, if asked, ``promtool``) is installed.

    Put in a module's ``pytestmark``, so each test file that needs a real Prometheus says it
    the same way, with one install hint. Not in CI (``CI`` set), where ``.ci/run`` installs
    both: there a missing binary fails the run instead of skipping these tests unseen.
    """
    missing = prometheus_binary() is None or (promtool and promtool_binary() is None)
    reason = "prometheus is not installed (apt-get install prometheus, or make services)"
    if missing and os.environ.get("CI"):
        raise RuntimeError(f"{reason}: .ci/run installs it, and CI must not skip these tests")
    return pytest.mark.skipif(missing, reason=reason)


def wait_until(check: Callable[[], Any], what: str, seconds: float = READY_SECONDS) -> Any:
    """Poll ``check`` until it answers something truthy; fail naming ``what`` after ``seconds``."""
    give_up = time.monotonic() + seconds
    last_error: Exception | None = None
    while time.monotonic() < give_up:
        try:
            answer = check()
        except (httpx.HTTPError, OSError) as exc:
            last_error, answer = exc, None
        if answer:
            return answer
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}" + (f": {last_error}" if last_error else ""))


@dataclass
class Prometheus:
    """A running Prometheus and a client for its HTTP API."""

    url: str
    client: httpx.Client
    log_path: Path
    targets: Mapping[str, Sequence[str]]  # each job's targets, as configured

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; answers the result list (vector or scalar, as returned)."""
        response = self.client.get(f"{self.url}/api/v1/query", params={"query": expr})
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"query failed: {expr}\n{json.dumps(body)}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def values(self, expr: str, by: str | None = None) -> dict[str, float]:
        """An instant query's values, keyed by the ``by`` label (or ``""``)."""
        out: dict[str, float] = {}
        for series in self.query(expr):
            key = series["metric"].get(by, "") if by else ""
            out[key] = float(series["value"][1])
        return out

    def scrape_count(self, job: str) -> int:
        """The scrapes of ``job``'s least scraped target (0 while one has had none)."""
        found = self.values(f'count_over_time(up{{job="{job}"}}[1h])', by="instance")
        if len(found) < len(self.targets[job]):
            return 0
        return int(min(found.values()))

    def wait_for_scrapes(self, job: str, count: int) -> None:
        """Wait until every target of ``job`` has been scraped ``count`` times, and is up."""
        wait_until(
            lambda: (
                self.scrape_count(job) >= count
                and all(v == 1 for v in self.values(f'up{{job="{job}"}}', by="instance").values())
            ),
            f"{count} scrapes of {job} (log: {self.log_path})",
        )

    def wait_for_more_scrapes(self, job: str, more: int = 2) -> None:
        """Wait for ``more`` scrapes after now, so what a target shows now is in the TSDB."""
        self.wait_for_scrapes(job, self.scrape_count(job) + more)

    def wait_for_value(self, expr: str, expected: float) -> None:
        wait_until(
            lambda: any(abs(v - expected) < 1e-9 for v in self.values(expr).values()),
            f"{expr} == {expected}",
        )


def write_config(
    path: Path,
    targets: Mapping[str, Sequence[str]],
    rule_files: Sequence[Path] = (),
    scrape_interval: str = "1s",
    job_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """A prometheus.yml scraping each job's targets every ``scrape_interval`` (JSON is YAML),
    with ``job_options[job]`` (``authorization``, say) added to that job's scrape config."""
    options = job_options or {}
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(hosts)}], **options.get(job, {})}
            for job, hosts in targets.items()
        ],
    }
    path.write_text(json.dumps(config, indent=2))
    return path


@contextmanager
def run_prometheus(
    workdir: Path,
    targets: Mapping[str, Sequence[str]],
    rule_files: Sequence[Path] = (),
    scrape_interval: str = "1s",
    job_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Iterator[Prometheus]:
    """Start ``prometheus`` on a free loopback port with its own TSDB; stop it on exit."""
    binary = prometheus_binary()
    if binary is None:
        raise RuntimeError("prometheus is not installed (apt-get install prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_config(
        workdir / "prometheus.yml", targets, rule_files, scrape_interval, job_options
    )
    port = free_port()
    log_path = workdir / "prometheus.log"
    with log_path.open("wb") as log, httpx.Client(timeout=10) as client:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                if process.poll() is not None:
                    raise AssertionError(f"prometheus exited: {log_path.read_text()}")
                return client.get(f"{url}/-/ready").status_code == 200

            wait_until(ready, f"prometheus to be ready (log: {log_path})")
            yield Prometheus(url=url, client=client, log_path=log_path, targets=targets)
        finally:
            stop(process)


def stop(process: subprocess.Popen[Any], seconds: float = 20.0) -> None:
    """Terminate, wait, and kill only if it would not stop."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class MetricsTarget:
    """A child process serving ``/metrics``, driven by lines on its stdin."""

    process: subprocess.Popen[str]
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def send(self, line: str) -> dict[str, Any]:
        """Send one command line; answers the JSON line the target prints back."""
        stdin, stdout = _pipe(self.process.stdin), _pipe(self.process.stdout)
        stdin.write(line + "\n")
        stdin.flush()
        answer: dict[str, Any] = json.loads(stdout.readline())
        return answer


def _pipe(stream: IO[str] | None) -> IO[str]:
    assert stream is not None
    return stream


@contextmanager
def run_metrics_target(module: str, *args: str) -> Iterator[MetricsTarget]:
    """Run ``python -m module *args``; it prints ``{"port": N}`` first, and stops at stdin EOF."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(_pipe(process.stdout).readline() or "{}")
        if "port" not in first:
            raise AssertionError(f"{module} did not start (exit code {process.wait()})")
        yield MetricsTarget(process=process, port=int(first["port"]))
    finally:
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        stop(process)


@contextmanager
def scrape_target(
    workdir: Path, job: str, command: Sequence[str], rule_files: Sequence[Path] = ()
) -> Iterator[tuple[MetricsTarget, Prometheus]]:
    """Run the metrics target ``python -m module *args`` and a Prometheus scraping it as ``job``.

    ``command`` is ``[module, *args]``. The target is given ``workdir / "multiproc"`` as its
    first argument (its ``PROMETHEUS_MULTIPROC_DIR``), before ``args``; Prometheus keeps its
    TSDB under ``workdir / "server"``.
    """
    module, *args = command
    with (
        run_metrics_target(module, str(workdir / "multiproc"), *args) as target,
        run_prometheus(workdir / "server", {job: [target.address]}, rule_files) as prometheus,
    ):
        yield target, prometheus


# --- dashboards ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def panels(dashboard: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panels(panel)


def panel_queries(path: Path) -> list[PanelQuery]:
    dashboard = json.loads(path.read_text())
    return [
        PanelQuery(dashboard["uid"], panel["title"], target["refId"], target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def dashboard_queries(*, rate_limits: bool) -> list[PanelQuery]:
    """The panel queries of the rate-limits dashboard (``True``) or of every other dashboard."""
    return [
        query
        for path in DASHBOARDS
        if (path.name == RATE_LIMITS_DASHBOARD) == rate_limits
        for query in panel_queries(path)
    ]


def concrete(expr: str, variables: Mapping[str, str] = GRAFANA_VARIABLES) -> str:
    """The expression with Grafana's ``$var`` and ``${var}`` replaced by concrete values."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"no test value for Grafana variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


def assert_panel_has_data(prometheus: Prometheus, query: PanelQuery) -> None:
    """A panel's query, its Grafana variables filled in, answers at least one finite value."""
    result = prometheus.query(concrete(query.expr))
    assert result, f"no data for {query}: {query.expr}"
    values = [float(series["value"][1]) for series in result]
    assert any(math.isfinite(v) for v in values), f"only NaN for {query}: {result}"
