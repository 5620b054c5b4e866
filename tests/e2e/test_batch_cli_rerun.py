"""``sift batch`` run again on the same file, after its first run was killed: the real CLI as
a process (SIGKILL is what a lost terminal or an OOM does), the gateway and worker as
processes.

Before, each run sent a random ``Idempotency-Key``: a run killed after its submit, and run
again, made a second batch of the same queries, every item searched (and reranked, and paid
for) twice, with no command to pick up the first. Now the key is the request's own digest:
the same file and options are answered with the batch the first run made, for the gateway's
24 hours (``--new`` sends it as another), and a batch canceled since is not picked up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tests.e2e.conftest import ACME, INDEX, Stack
from tests.reliability.support import answered_once
from worker.cli import app

REPO = Path(__file__).resolve().parents[2]
KEY = ACME["Authorization"].split()[1]
SUBMITTED = re.compile(r"batch (bat_[0-9a-f]+)")


def _queries(tmp_path: Path, queries: list[str], tag: str, count: int = 12) -> Path:
    source = tmp_path / f"{tag}.jsonl"
    lines = [{"id": f"{tag}{i}", "query": queries[i % len(queries)]} for i in range(count)]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return source


def _killed_after_submit(url: str, args: list[str]) -> tuple[str, int]:
    """Run ``sift`` as a process, SIGKILL it once it has said which batch it submitted (or
    picked up), and answer that batch's id and the process's pid."""
    env = {**os.environ, "SIFT_URL": url, "SIFT_API_KEY": KEY, "COLUMNS": "200",
           "NO_COLOR": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            seen.append(line)
            if found := SUBMITTED.search(line):
                return found.group(1), process.pid
        raise AssertionError("no batch submitted: " + "".join(seen))
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        process.stdout.close()


def _sift(url: str, *args: str) -> Result:
    env = {"SIFT_URL": url, "SIFT_API_KEY": KEY, "COLUMNS": "200", "NO_COLOR": "1"}
    return CliRunner().invoke(app, list(args), env=env)


def _batches(stack: Stack, client_url: str) -> dict[str, str]:
    client = stack.live if client_url == stack.live_url else stack.idle
    listed = client.get("/v1/batches", params={"page_size": 1000}, headers=ACME)
    assert listed.status_code == 200, listed.text
    return {b["id"]: b["status"] for b in listed.json()["batches"]}


def test_a_batch_run_again_after_a_kill_picks_up_the_batch_its_first_run_made(
    stack: Stack, corpus: object, queries: list[str], tmp_path: Path
) -> None:
    source, out = _queries(tmp_path, queries, "rerun"), tmp_path / "results.jsonl"
    args = ["batch", str(source), "--index", INDEX, "--out", str(out)]
    before = _batches(stack, stack.live_url)
    first, pid = _killed_after_submit(stack.live_url, args)
    # what a run killed while writing the results leaves: its temp file, named for its pid
    left = tmp_path / f".results.jsonl.{pid}.partial"
    left.write_text('{"half": ')
    again = _sift(stack.live_url, *args)
    assert again.exit_code == 0, again.output
    assert f"batch {first}" in again.output and "picked up" in again.output, again.output
    assert set(_batches(stack, stack.live_url)) - set(before) == {first}  # one batch, not two
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["query_id"] for r in written) == sorted(f"rerun{i}" for i in range(12))
    assert {r["status"] for r in written} == {"succeeded"}
    assert not left.exists()  # swept: the process that wrote it is gone
    # --new sends the same file as another batch
    fresh = _sift(stack.live_url, *args, "--new")
    assert fresh.exit_code == 0, fresh.output
    made = set(_batches(stack, stack.live_url)) - set(before)
    assert len(made) == 2 and first in made, made


def _canceled_then_sent_again(stack: Stack, args: list[str]) -> tuple[str, str]:
    """The first run's batch (its command killed once it was sent) canceled, and the batch a
    run again sent instead: their ids."""
    first, _ = _killed_after_submit(stack.idle_url, args)
    canceled = stack.idle.delete(f"/v1/batches/{first}", headers=ACME)
    assert canceled.status_code == 200 and canceled.json()["status"] == "canceled"
    second, _ = _killed_after_submit(stack.idle_url, args)
    assert second != first
    return first, second


def test_a_batch_canceled_since_its_run_is_not_picked_up_again(
    stack: Stack, queries: list[str], tmp_path: Path
) -> None:
    """On the gateway no worker serves, so the batches stay queued: the first run killed, its
    batch canceled, a run again sends the file as a new batch (and a third run picks that one
    up, not a third); the canceled batch's results would be no answer to running the file."""
    source, out = _queries(tmp_path, queries, "cancel"), tmp_path / "results.jsonl"
    args = ["batch", str(source), "--index", INDEX, "--out", str(out)]
    before = _batches(stack, stack.idle_url)
    first, second = _canceled_then_sent_again(stack, args)
    assert _killed_after_submit(stack.idle_url, args)[0] == second
    made = {k: v for k, v in _batches(stack, stack.idle_url).items() if k not in before}
    assert made == {first: "canceled", second: "queued"}
    stack.idle.delete(f"/v1/batches/{second}", headers=ACME)


@pytest.mark.parametrize("field", ["_id", "id"])
def test_a_bad_id_names_the_field_as_the_line_spells_it(tmp_path: Path, field: str) -> None:
    """A BEIR line's ``_id`` that is not a string is named ``_id``, as written (it was named
    ``id``, a field the line does not have). Refused before anything is sent."""
    source = tmp_path / "bad.jsonl"
    text = "text" if field == "_id" else "query"  # BEIR's line, or Sift's
    source.write_text(json.dumps({field: 1, text: "x"}) + "\n")
    result = _sift("http://127.0.0.1:9", "batch", str(source), "--index", INDEX,
                   "--out", str(tmp_path / "out.jsonl"))  # fmt: skip
    assert result.exit_code == 1, result.output
    assert f"field '{field}'" in result.output and "nothing was sent" in result.output, (
        result.output
    )


def test_a_bad_document_id_names_the_field_as_the_line_spells_it(
    tmp_path: Path, stack: Stack
) -> None:
    """Against a gateway that answers (``sift ingest`` asks it first, before reading the
    file), the line is refused as it spells its id, and nothing is sent."""
    source = tmp_path / "corpus.jsonl"
    source.write_text(json.dumps({"_id": 5, "text": "x"}) + "\n")
    result = _sift(stack.idle_url, "ingest", str(source), "--index", INDEX)
    assert result.exit_code == 1, result.output
    assert "field '_id'" in result.output and "nothing was sent" in result.output, result.output


def test_a_batch_erased_since_its_run_is_sent_again_as_a_new_one(
    stack: Stack, corpus: object, queries: list[str], tmp_path: Path
) -> None:
    """A finished batch erased (``sift erase``), the same command run again sends the file as
    a new batch and says why; run a third time, it picks that one up. Before, its key still
    named the erased batch: the run failed with a bare ``410`` for the key's 24 hours."""
    source, out = _queries(tmp_path, queries, "erase"), tmp_path / "results.jsonl"
    args = ["batch", str(source), "--index", INDEX, "--out", str(out)]
    before = _batches(stack, stack.live_url)
    first_run = _sift(stack.live_url, *args)
    assert first_run.exit_code == 0, first_run.output
    (first,) = set(_batches(stack, stack.live_url)) - set(before)
    erased = _sift(stack.live_url, "erase", first)
    assert erased.exit_code == 0, erased.output
    again = _sift(stack.live_url, *args)
    assert again.exit_code == 0, again.output
    said = " ".join(again.output.split())
    assert "batch of this file is no longer kept" in said and first in said, said
    assert "sending the file as a new batch" in said, said
    made = set(_batches(stack, stack.live_url)) - set(before)
    assert first not in made and len(made) == 1, made
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["query_id"] for r in written) == sorted(f"erase{i}" for i in range(12))
    third = _sift(stack.live_url, *args)
    assert third.exit_code == 0 and "picked up" in third.output, third.output
    assert set(_batches(stack, stack.live_url)) - set(before) == made


def test_a_batch_whose_cancel_canceled_nothing_is_picked_up_again(
    stack: Stack, corpus: object, queries: list[str], tmp_path: Path
) -> None:
    """A cancel that comes while every item is with the model cancels none of them: they
    finish, and the batch ends ``succeeded`` with every result, its ``canceled_at`` set (a
    Ctrl-C of ``sift batch`` a second in). A run again picks it up. Before, any batch with a
    ``canceled_at`` was passed over: the file was sent as a new batch, each item searched
    and paid for twice."""
    count = 4
    source, out = _queries(tmp_path, queries, "uncanceled", count), tmp_path / "results.jsonl"
    args = ["batch", str(source), "--index", INDEX, "--out", str(out), "--rerank"]
    before = _batches(stack, stack.live_url)
    answered_once(stack.live, stack.model)  # the deployment's first answer, before the hold
    received = stack.model.counts()["received"]
    stack.model.configure(hold_unscripted=True)
    try:
        first, _ = _killed_after_submit(stack.live_url, args)
        deadline = time.monotonic() + 60  # a hang guard, not a speed check
        while stack.model.counts()["received"] < received + count:  # every item's call held
            assert time.monotonic() < deadline, stack.model.counts()
            time.sleep(0.05)
        canceled = stack.live.delete(f"/v1/batches/{first}", headers=ACME)
        assert canceled.status_code == 200 and canceled.json()["status"] == "running"
    finally:
        stack.model.configure(hold_unscripted=False)
    again = _sift(stack.live_url, *args)
    assert again.exit_code == 0, again.output
    assert f"batch {first}" in again.output and "picked up" in again.output, again.output
    ended = stack.live.get(f"/v1/batches/{first}", headers=ACME).json()
    assert ended["status"] == "succeeded" and ended["canceled_at"], ended
    assert set(_batches(stack, stack.live_url)) - set(before) == {first}  # one batch, not two
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["query_id"] for r in written) == sorted(f"uncanceled{i}" for i in range(count))
    assert {r["status"] for r in written} == {"succeeded"}


def test_a_canceled_batch_erased_since_leaves_the_batch_sent_after_it_to_pick_up(
    stack: Stack, queries: list[str], tmp_path: Path
) -> None:
    """On the gateway no worker serves: the first run's batch canceled, a run again sends
    the file as a second batch; the canceled one erased then (tidying what was canceled), a
    third run picks up the second, as it did before the erase. Before, the erased batch's
    key sent the file as a third batch, each item searched and paid for again."""
    source, out = _queries(tmp_path, queries, "tidied"), tmp_path / "results.jsonl"
    args = ["batch", str(source), "--index", INDEX, "--out", str(out)]
    before = _batches(stack, stack.idle_url)
    first, second = _canceled_then_sent_again(stack, args)
    erased = stack.idle.delete(f"/v1/batches/{first}/results", headers=ACME)
    assert erased.status_code == 200, erased.text
    try:
        assert _killed_after_submit(stack.idle_url, args)[0] == second
    finally:
        for made in set(_batches(stack, stack.idle_url)) - set(before):
            stack.idle.delete(f"/v1/batches/{made}", headers=ACME)
    assert set(_batches(stack, stack.idle_url)) - set(before) == {second}
