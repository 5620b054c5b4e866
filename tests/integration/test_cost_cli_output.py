"""``sift cost``'s streams and its errors, against a real Prometheus with nothing scraped yet
(every query an empty vector, as on a fresh deployment).

``--json`` printed ``wrote f.png`` after the JSON, and an error too, on stdout: a script's
``json.loads`` failed. A ``--png`` into a folder that does not exist was a traceback. Now
stdout holds the JSON alone, the rest goes to stderr, and an unwritable PNG is one line,
exit 1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.prometheus_support import Prometheus, free_port, requires_prometheus, run_prometheus
from worker.cli import app

pytestmark = [pytest.mark.integration, requires_prometheus()]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    with run_prometheus(tmp_path_factory.mktemp("prometheus"), {}) as running:
        yield running


def _cost(*args: str) -> tuple[int, str, str, BaseException | None]:
    run = CliRunner().invoke(app, ["cost", *args], env={"COLUMNS": "160", "NO_COLOR": "1"})
    return run.exit_code, run.stdout, run.stderr, run.exception


def test_json_is_all_that_stdout_holds(prometheus: Prometheus, tmp_path: Path) -> None:
    png = tmp_path / "c.png"
    code, out, err, _ = _cost("--prometheus-url", prometheus.url, "--json", "--png", str(png))
    assert code == 0, out + err
    assert json.loads(out)["window"] == "1h", out
    assert f"wrote {png}" in " ".join(err.split()) and png.read_bytes()[:4] == b"\x89PNG"


def test_an_error_under_json_goes_to_stderr() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err, _ = _cost("--prometheus-url", url, "--json")
    assert code == 1 and out == "", out
    assert "did not answer" in err, err


def test_a_png_that_cannot_be_written_is_one_line(prometheus: Prometheus, tmp_path: Path) -> None:
    png = tmp_path / "no-such-folder" / "c.png"
    code, out, err, exception = _cost("--prometheus-url", prometheus.url, "--png", str(png))
    assert exception is None or isinstance(exception, SystemExit), repr(exception)
    assert code == 1, out + err
    assert "error:" in err and str(png) in " ".join(err.split()), err
    assert "Traceback" not in err and not png.parent.exists()
