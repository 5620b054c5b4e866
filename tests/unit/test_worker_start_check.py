"""``sift worker``'s start-up check of its backend: what stops it (exit 2) and what only warns.

The subprocess runs of the two fatal cases a store can hold are in
``tests/integration/test_embedded_backend.py`` (a data dir of another schema) and
``tests/integration/test_elasticsearch_contract.py`` (the old shared layout); these pin the
rule between them: a ConfigError always stops the worker, any other error of the embedded
backend too, and an Elasticsearch cluster that cannot be read only warns (jobs retry)."""

from __future__ import annotations

from pathlib import Path

import apsw
import pytest
import typer

import worker.runtime.bootstrap
from worker.cli.service import _check_backend
from worker.errors import BackendUnavailable, ConfigError, SiftError
from worker.processes.stack import free_port
from worker.settings import Settings


class Backend:
    """A backend whose check raises ``error`` (or passes), and which says if it was closed."""

    def __init__(self, error: SiftError | None) -> None:
        self.error, self.closed = error, False

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("backend", "error", "stops"),
    [
        ("embedded", ConfigError("a data dir of another schema"), True),
        ("embedded", BackendUnavailable("disk I/O error"), True),
        ("elasticsearch", ConfigError("the old shared layout"), True),
        ("elasticsearch", BackendUnavailable("Connection error"), False),
        ("embedded", None, False),
    ],
)
def test_what_stops_the_worker_and_what_only_warns(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    backend: str,
    error: SiftError | None,
    stops: bool,
) -> None:
    built = Backend(error)
    monkeypatch.setattr(worker.runtime.bootstrap, "build_backend", lambda settings: built)
    settings = Settings(search_backend=backend, elasticsearch_url="http://127.0.0.1:9")
    if stops:
        with pytest.raises(typer.Exit) as exit_:
            _check_backend(settings)
        assert exit_.value.exit_code == 2
        assert f"error: {error}" in capsys.readouterr().err
    else:
        _check_backend(settings)
        out = capsys.readouterr().err
        assert (f"warning: could not check the indexes' layout: {error}" in out) == bool(error)
    assert built.closed  # the check's own connections are not left to the worker


def test_an_elasticsearch_that_does_not_answer_warns_and_one_not_set_stops(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The real adapter: a refused connection is a warning; no URL is a ConfigError."""
    port = free_port()  # nothing listens on it
    _check_backend(
        Settings(search_backend="elasticsearch", elasticsearch_url=f"http://127.0.0.1:{port}")
    )
    assert "warning: could not check the indexes' layout" in capsys.readouterr().err
    with pytest.raises(typer.Exit) as exit_:
        _check_backend(Settings(search_backend="elasticsearch"))
    assert exit_.value.exit_code == 2
    assert "needs SIFT_ELASTICSEARCH_URL" in capsys.readouterr().err


def test_the_embedded_data_dir_is_made_or_refused(tmp_path: Path) -> None:
    """A new data dir gets its schema; one of another schema version stops the worker."""
    _check_backend(Settings(data_dir=tmp_path / "new"))
    assert (tmp_path / "new" / "sift.db").exists()
    old = tmp_path / "old"
    old.mkdir()
    conn = apsw.Connection(str(old / "sift.db"))
    conn.execute("CREATE TABLE docs(x); PRAGMA user_version=1")
    conn.close()
    with pytest.raises(typer.Exit) as exit_:
        _check_backend(Settings(data_dir=old))
    assert exit_.value.exit_code == 2


@pytest.mark.parametrize(
    ("changes", "stops"),
    [
        ({"worker_pool": "prefork"}, True),  # 300 children a process, each with the model
        ({"worker_pool": "prefork", "worker_concurrency": 2}, False),
        ({"worker_pool": "prefork", "worker_concurrency": 300}, False),  # asked for: taken
        ({"worker_pool": "threads"}, False),
        ({}, False),
    ],
)
def test_a_prefork_pool_needs_its_own_concurrency(
    capsys: pytest.CaptureFixture[str], changes: dict[str, object], stops: bool
) -> None:
    """``SIFT_WORKER_CONCURRENCY``'s default, 300, is the threads pool's: under prefork it
    forked 300 children per worker process, each loading the embedding model at its first
    task. Prefork without a concurrency of its own stops the worker, naming both."""
    from worker.cli.service import _require_pool_concurrency

    settings = Settings(**changes)  # type: ignore[arg-type]
    if stops:
        with pytest.raises(typer.Exit) as exit_:
            _require_pool_concurrency(settings)
        assert exit_.value.exit_code == 2
        out = capsys.readouterr().err
        assert "SIFT_WORKER_POOL=prefork" in out and "SIFT_WORKER_CONCURRENCY" in out, out
    else:
        _require_pool_concurrency(settings)
