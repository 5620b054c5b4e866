"""A bad option value is a usage error that names the option, exit 2, as typer's own are
(``Invalid value for '--x'``), before anything is sent or started.

Before: ``sift index set --knn-weight -1`` went to the gateway and came back naming the API's
``fusion.weights.knn``, exit 1; ``sift up --port 99999`` named ``SIFT_GATEWAY_PORT``, the
variable the user had not set; ``--mode``, ``--lane`` and ``--status`` of no known value,
``--limit`` with ``--all`` and ``sift index set`` with no setting exited 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from worker.cli import app

# no gateway, and no Redis: a service command whose option went unchecked stops there
NOWHERE = {"SIFT_URL": "http://127.0.0.1:9", "SIFT_API_KEY": "k", "SIFT_REDIS_URL": "",
           "COLUMNS": "200"}  # fmt: skip


def sift(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env=NOWHERE)


def usage_error(result: Result, option: str) -> None:
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "option", "not_named"),
    [
        (["--knn-weight", "-1"], "--knn-weight", "fusion.weights.knn"),
        (["--bm25-weight", "nan"], "--bm25-weight", "fusion.weights.bm25"),
        (["--rank-constant", "0"], "--rank-constant", "fusion.rank_constant"),
        (["--candidate-limit", "0"], "--candidate-limit", "candidate_limit"),
        (["--bm25-weight", "0", "--knn-weight", "0"], "--bm25-weight' / '--knn-weight", "fusion"),
    ],
)
def test_index_set_names_the_option_not_the_api_field(
    args: list[str], option: str, not_named: str
) -> None:
    result = sift("index", "set", "demo", *args)
    usage_error(result, option)
    assert not_named not in result.output
    assert "no gateway" not in result.output  # checked here: nothing was sent


def test_index_set_with_no_setting_is_a_usage_error() -> None:
    result = sift("index", "set", "demo")
    assert result.exit_code == 2 and "give at least one setting" in result.output


@pytest.mark.parametrize(
    ("args", "option", "variable"),
    [
        (["up", "--port", "99999"], "--port", "SIFT_GATEWAY_PORT"),
        (["up", "--metrics-port", "-1"], "--metrics-port", "SIFT_WORKER_METRICS_PORT"),
        (["gateway", "--port", "70000"], "--port", "SIFT_GATEWAY_PORT"),
        (["worker", "--pool", "gevent"], "--pool", "SIFT_WORKER_POOL"),
        (["worker", "--concurrency", "99999"], "--concurrency", "SIFT_WORKER_CONCURRENCY"),
        # 0 was taken for no option: the worker ran at SIFT_WORKER_CONCURRENCY's 300 threads
        (["worker", "--concurrency", "0"], "--concurrency", "SIFT_WORKER_CONCURRENCY"),
        # it went to Celery unchecked: every worker process stopped on a traceback, restarted
        (["worker", "--loglevel", "loud"], "--loglevel", "SIFT_LOG_LEVEL"),
    ],
)
def test_a_service_option_is_named_not_its_variable(
    args: list[str], option: str, variable: str
) -> None:
    result = sift(*args)
    usage_error(result, option)
    assert variable not in result.output


def test_an_empty_data_dir_is_refused_as_its_variable_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """typer reads ``--data-dir ""`` as ``Path(".")``: ``sift up`` ran its stack (Redis's
    AOF, the logs, the dev key) in the working directory, and ``sift eval`` its index, where
    ``SIFT_DATA_DIR=""`` stops. (The ports given clash: were the folder taken, ``sift up``
    would stop on them, before starting anything.)"""
    monkeypatch.chdir(tmp_path)
    for args in (
        ["up", "--data-dir", "", "--port", "27399", "--metrics-port", "27399"],
        ["eval", "--corpus", "c.jsonl", "--queries", "q.jsonl", "--qrels", "r.tsv",
         "--data-dir", " "],
    ):  # fmt: skip
        for name in ("c.jsonl", "q.jsonl", "r.tsv"):
            (tmp_path / name).write_text("")
        result = sift(*args)
        usage_error(result, "--data-dir")
        assert "is empty: give a folder" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "q.jsonl", "r.tsv"]


@pytest.mark.parametrize(
    "factory", ["nosuchmodule:build", "worker.settings:no_such_function", "worker.settings:DAY"]
)
def test_a_runtime_factory_that_cannot_be_loaded_stops_the_worker(factory: str) -> None:
    """It was imported at the first job: the worker started, and failed every job."""
    result = CliRunner().invoke(app, ["worker"], env={**NOWHERE, "SIFT_RUNTIME_FACTORY": factory})
    assert result.exit_code == 2, result.output
    assert "SIFT_RUNTIME_FACTORY" in result.output and factory in result.output, result.output
    assert "Traceback" not in result.output


def test_a_runtime_factory_that_loads_is_taken() -> None:
    """The worker goes on to what it lacks here, a Redis."""
    factory = "tests.reliability.holding_runtime:build_runtime"
    result = CliRunner().invoke(app, ["worker"], env={**NOWHERE, "SIFT_RUNTIME_FACTORY": factory})
    assert result.exit_code == 2 and "SIFT_REDIS_URL is required" in result.output, result.output


def test_a_log_level_in_lower_case_is_taken() -> None:
    """Celery's own spelling (``--loglevel info``) is SIFT_LOG_LEVEL's ``INFO``: the worker
    goes on to what it lacks here, a Redis."""
    result = sift("worker", "--loglevel", "info")
    assert result.exit_code == 2 and "SIFT_REDIS_URL is required" in result.output, result.output


@pytest.mark.parametrize("queues", ["bogus", "sift.search,sift.serch", "", "sift.search,"])
def test_a_worker_queue_of_no_known_name(queues: str) -> None:
    """A queue Sift does not route to went to Celery unchecked: each worker process stopped
    on its ImproperlyConfigured traceback and was restarted after a back-off, for good."""
    usage_error(sift("worker", "--queues", queues), "--queues")


def test_a_worker_of_some_queues_is_taken() -> None:
    result = sift("worker", "--queues", "sift.search, sift.webhooks")
    assert result.exit_code == 2 and "SIFT_REDIS_URL is required" in result.output, result.output


def test_search_mode_of_no_known_value(tmp_path: Path) -> None:
    usage_error(sift("search", "q", "--index", "s", "--mode", "foo"), "--mode")


@pytest.mark.parametrize(("option", "value"), [("--mode", "foo"), ("--lane", "fast")])
def test_batch_option_of_no_known_value(tmp_path: Path, option: str, value: str) -> None:
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "q1", "query": "tea"}\n')
    out = str(tmp_path / "out.jsonl")
    usage_error(sift("batch", str(queries), "--index", "s", "--out", out, option, value), option)


@pytest.mark.parametrize("command", ["searches", "batches", "ingestions"])
def test_status_of_no_known_value(command: str) -> None:
    usage_error(sift(command, "--status", "bogus"), "--status")


def test_documents_list_limit_and_all() -> None:
    usage_error(sift("documents", "list", "demo", "--all", "--limit", "2"), "--limit' / '--all")


@pytest.mark.parametrize(
    "args",
    [
        ["search", "tea \udcff", "--index", "demo"],  # argv's byte 0xff, as Python decodes it
        ["documents", "get", "\udcff", "--index", "demo"],
        ["documents", "delete", "d1", "\udcff", "--index", "demo"],
    ],
)
def test_an_argument_that_is_not_utf8_is_a_usage_error(args: list[str]) -> None:
    """A byte of the command line that is no UTF-8 (Python gives it as a lone surrogate) is a
    usage error naming the argument, before anything is sent: it was a traceback
    (``UnicodeEncodeError``) where the request was built."""
    result = sift(*args)
    assert result.exit_code == 2, result.output
    assert "Invalid value for" in result.output and "not UTF-8" in result.output, result.output
    assert isinstance(result.exception, SystemExit), result.output  # no traceback


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"id": "a\\ud800", "query": "tea"}', "id"),
        ('{"id": "a", "query": "tea \\udfff"}', "query"),
    ],
)
def test_a_query_line_that_is_not_unicode_names_the_line_and_field(
    tmp_path: Path, line: str, field: str
) -> None:
    """A lone surrogate, valid JSON, in a query line's id or text: ``sift batch`` named nothing
    and stopped on a traceback (``UnicodeEncodeError``) as it sent the batch."""
    queries = tmp_path / "queries.jsonl"
    queries.write_text(line + "\n")
    result = sift("batch", str(queries), "--index", "demo", "--out", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    assert f"queries.jsonl:1: field '{field}': is not valid Unicode" in output, output
    assert "nothing was sent" in output and isinstance(result.exception, SystemExit), output


def test_a_query_id_longer_than_the_gateway_takes_names_the_line(tmp_path: Path) -> None:
    """An id past the gateway's 256 characters was sent, and the batch refused as a whole
    naming ``queries[i].id``: an index into the batch, not the file's line (blank and
    skipped lines shift one from the other). It is a bad line, found before anything is sent."""
    queries = tmp_path / "queries.jsonl"
    long = '{"id": "' + "q" * 257 + '", "query": "x"}'
    queries.write_text('{"id": "ok", "query": "tea"}\n\n' + long + "\n")
    result = sift("batch", str(queries), "--index", "demo", "--out", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    assert "queries.jsonl:3: field 'id': longer than 256 characters" in output, output
    assert "nothing was sent" in output, output
