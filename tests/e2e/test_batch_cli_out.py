"""``sift batch --out`` over the real stack (the CLI in-process through typer's runner, the
gateway and worker as processes): a results path that cannot be written is refused before the
batch is sent.

Before, the command submitted the batch, waited for every item (searches and model calls spent)
and only then opened the file: a folder, or a place it may not write, ended in a traceback
(``IsADirectoryError``, ``FileNotFoundError``) with no results file, no word of ``--out``, and
a finished batch the user did not know how to read.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from tests.e2e.conftest import ACME, IDLE_BODY_LIMIT, INDEX, SAMPLE, Stack
from tests.fake_anthropic import malformed, status
from worker.cli import app


def sift(stack: Stack, *args: str) -> Result:
    key = ACME["Authorization"].split()[1]
    env = {"SIFT_URL": stack.live_url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
    return CliRunner().invoke(app, list(args), env=env)


def batch_ids(stack: Stack) -> set[str]:
    listed = stack.live.get("/v1/batches", params={"page_size": 1000}, headers=ACME)
    assert listed.status_code == 200, listed.text
    return {b["id"] for b in listed.json()["batches"]}


@pytest.mark.parametrize("where", ["a folder", "under a file", "under /proc"])
def test_an_out_that_cannot_be_written_is_refused_before_the_batch_is_sent(
    stack: Stack, corpus: list[dict[str, object]], tmp_path: Path, where: str
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    out = {
        "a folder": tmp_path,
        "under a file": a_file / "results.jsonl",
        "under /proc": Path("/proc/sift-results.jsonl"),
    }[where]
    before = batch_ids(stack)
    result = sift(stack, "batch", str(SAMPLE / "sample_queries.jsonl"),
                  "--index", INDEX, "--out", str(out))  # fmt: skip
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "--out" in result.output and str(out) in result.output, result.output
    assert "nothing was sent" in result.output, result.output
    if where == "under a file":  # the reason, not the mkdir's "File exists"
        assert f"{a_file} is a file, not a folder" in " ".join(result.output.split())
    assert batch_ids(stack) == before  # no batch made, nothing spent


@pytest.mark.parametrize("named", ["as given", "through a symlinked folder"])
def test_an_out_naming_the_queries_file_is_refused_before_the_batch_is_sent(
    stack: Stack, corpus: list[dict[str, object]], tmp_path: Path, named: str
) -> None:
    """The results would replace the queries, which no results line holds: the file was
    lost, and the command it said to run again then read results as queries."""
    queries = tmp_path / "queries.jsonl"
    text = (SAMPLE / "sample_queries.jsonl").read_text()
    queries.write_text(text)
    out = queries
    if named == "through a symlinked folder":
        (tmp_path / "link").symlink_to(tmp_path)
        out = tmp_path / "link" / "queries.jsonl"
    before = batch_ids(stack)
    result = sift(stack, "batch", str(queries), "--index", INDEX, "--out", str(out))
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert f"--out: {out} is the queries file" in said and "nothing was sent" in said, said
    assert queries.read_text() == text
    assert batch_ids(stack) == before  # no batch made, nothing spent


def test_an_out_in_a_new_folder_is_written(
    stack: Stack, corpus: list[dict[str, object]], tmp_path: Path
) -> None:
    out = tmp_path / "new" / "folder" / "results.jsonl"
    result = sift(stack, "batch", str(SAMPLE / "sample_queries.jsonl"),
                  "--index", INDEX, "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 10
    assert [p.name for p in out.parent.iterdir()] == ["results.jsonl"]  # no probe left behind


def test_a_reranked_batch_prints_what_its_model_calls_used_and_cost(
    stack: Stack, corpus: list[dict[str, object]], tmp_path: Path
) -> None:
    # the summary's usage is the batch record's, which is its items' summed
    out = tmp_path / "results.jsonl"
    result = sift(stack, "batch", str(SAMPLE / "sample_queries.jsonl"),
                  "--index", INDEX, "--out", str(out), "--rerank")  # fmt: skip
    assert result.exit_code == 0, result.output
    usages = [json.loads(line)["result"]["usage"] for line in out.read_text().splitlines()]
    requests = sum(u["requests"] for u in usages)
    tokens = sum(u["input_tokens"] for u in usages)
    cost = sum(u["cost_usd"] for u in usages)
    assert requests == 10 and tokens > 0
    assert f"usage: {requests} request(s), {tokens} input + " in result.output, result.output
    assert f"${cost:.6f}" in result.output, result.output
    assert "rerank: applied 10, fallback 0, skipped 0" in result.output, result.output
    assert "seconds by stage (items succeeded or rerank_failed): queue wait " in result.output
    assert ", slot wait " in result.output  # its items' waits for a CPU slot, a stage of its own
    listed = sift(stack, "batches", "--limit", "1")  # and its row in the list, with its cost
    assert listed.exit_code == 0, listed.output
    assert f"${cost:.6f}" in listed.output and "cost" in listed.output, listed.output


def test_a_batch_s_summary_says_why_its_items_failed_by_kind_and_class(
    stack: Stack, corpus: list[dict[str, object]], tmp_path: Path
) -> None:
    # under fail_closed, the first two calls answered 400 fail their items (http_4xx, never
    # retried); the two items left take three malformed answers each (malformed)
    queries = tmp_path / "queries.jsonl"
    lines = [{"id": f"q{i}", "query": q} for i, q in enumerate(["tea", "bees", "leaves", "tea"])]
    queries.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stack.model.script([status(400), status(400)] + [malformed("no json here")] * 6)
    out = tmp_path / "results.jsonl"
    result = sift(stack, "batch", str(queries), "--index", INDEX, "--out", str(out), "--rerank")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "4 failed (rerank_failed 4 (http_4xx 2, malformed 2)), 0 canceled of 4" in said, said
    listed = sift(stack, "batches", "--limit", "1", "--json")  # the record's counts, as JSON
    assert listed.exit_code == 0, listed.output
    [entry] = json.loads(listed.stdout)
    assert entry["failures"] == {"rerank_failed": 4}, entry
    assert entry["rerank_failures"] == {"http_4xx": 2, "malformed": 2}, entry


def test_a_batch_over_the_gateways_body_limit_says_so_and_what_to_do(
    stack: Stack, tmp_path: Path
) -> None:
    """A queries file whose batch is over the gateway's ``SIFT_MAX_BODY_BYTES`` (the idle
    gateway's is 64 KiB; 100,000 queries of up to 2,000 characters pass the default 32 MiB)
    stopped with the gateway's 413 alone: no word of the setting, nor that the file is to be
    split (one ``sift batch`` run is one batch)."""
    queries = tmp_path / "long.jsonl"
    rows = [{"id": f"q{i}", "query": f"query {i} " + "w" * 1_900} for i in range(40)]
    queries.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.jsonl"
    env = {"SIFT_URL": stack.idle_url, "SIFT_API_KEY": ACME["Authorization"].split()[1],
           "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
    result = CliRunner().invoke(
        app, ["batch", str(queries), "--index", INDEX, "--out", str(out)], env=env
    )
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    assert f"larger than the limit of {IDLE_BODY_LIMIT} bytes" in output, output
    assert f"the 40 queries of {queries}" in output, output
    assert "SIFT_MAX_BODY_BYTES" in output and "split the file" in output, output
    assert not out.exists()


def test_a_batch_over_the_default_body_limit_is_refused_before_it_is_sent(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100,000 queries of 400 characters, within the item limit, are a 43 MB request, over
    the default ``SIFT_MAX_BODY_BYTES`` (32 MiB): the command sent all of it to be answered
    413. It now says so before sending, with the size, the limit and the setting, and into
    how many parts to split the file, which then fit."""
    queries = tmp_path / "many.jsonl"
    rows = (json.dumps({"id": f"q{i}", "query": f"q{i:06d} " + "w" * 392}) for i in range(100_000))
    queries.write_text("".join(row + "\n" for row in rows))
    sent: list[str] = []
    send = httpx.Client.send

    def recording(client: httpx.Client, request: httpx.Request, **kwargs: Any) -> Any:
        sent.append(f"{request.method} {request.url.path}")
        return send(client, request, **kwargs)

    monkeypatch.setattr(httpx.Client, "send", recording)
    before = batch_ids(stack)
    out = tmp_path / "results.jsonl"
    result = sift(stack, "batch", str(queries), "--index", INDEX, "--out", str(out))
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    limit = 32 * 1024 * 1024
    assert f"more than the gateway takes in one ({limit:,} bytes, SIFT_MAX_BODY_BYTES)" in output
    assert "its 100000 queries make a request of " in output, output
    assert "nothing was sent, no batch made: split the file into 2 parts or more" in output
    assert "POST /v1/batches" not in sent, sent
    assert batch_ids(stack) == before and not out.exists()
    split = subprocess.run(  # as it says: each part fits
        ["split", "-n", "l/2", str(queries), str(tmp_path / "part-")], check=True
    )
    assert split.returncode == 0
    parts = sorted(tmp_path.glob("part-*"))
    assert len(parts) == 2 and all(p.stat().st_size < 0.9 * limit for p in parts), parts


@pytest.mark.parametrize("text", ["\u200b\u00ad", "?!"], ids=["blank", "punctuation"])
def test_a_query_with_no_visible_character_is_a_bad_line_before_the_batch_is_sent(
    stack: Stack, tmp_path: Path, text: str
) -> None:
    """``sift batch`` checked a query with ``str.strip()``: a zero-width space or a soft
    hyphen passed as a line (``--skip-invalid`` kept it), and the whole batch was refused
    by the gateway's 422 instead of the line named. So does a query of punctuation alone,
    which the gateway refuses as well."""
    queries = tmp_path / "q.jsonl"
    rows = [{"id": "q1", "query": "tea"}, {"id": "q2", "query": text}]
    queries.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = batch_ids(stack)
    out = tmp_path / "results.jsonl"
    result = sift(stack, "batch", str(queries), "--index", INDEX, "--out", str(out))
    assert result.exit_code == 1, result.output
    assert "q.jsonl:2: field 'query'" in result.output, result.output
    assert "nothing was sent" in result.output, result.output
    assert batch_ids(stack) == before
