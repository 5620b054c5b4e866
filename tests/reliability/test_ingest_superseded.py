"""``sift ingest`` of a file whose documents a drop voids on their way in, on a real gateway
and ``sift worker`` (its ingest held before it embeds: ``holding_runtime``).

The drop is accepted while the first line's job runs, and lands first: the job then writes
none of its documents (a write accepted after theirs holds their ids) and succeeds with
``upserted`` 0, as the index lifecycle wants; the second line, the same id sent after the
drop, is written. The command said "indexed 1 document(s)", exit 0, with no word of the
document it sent that was not written.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from tests.reliability.support import ACME, KEYS, wait_for
from tests.services import celery_worker, gateway, redis_server
from worker.cli import app

pytestmark = pytest.mark.integration

INDEX = "voided"


@contextmanager
def holding_stack(tmp_path: Path, holds: Path) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    """redis-server, the gateway and a ``sift worker`` whose ingests ``holding_runtime`` holds
    (``holds``: its folder); a client of the gateway and the CLI's environment."""
    with redis_server(tmp_path / "redis") as url:
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_API_KEYS": json.dumps(KEYS),
               "SIFT_RUNTIME_FACTORY": "tests.reliability.holding_runtime:build_runtime",
               "HOLD_DIR": str(holds)}  # fmt: skip
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=60) as client,
            celery_worker(tmp_path / "w", env, "w"),
        ):
            yield client, {"SIFT_URL": base, "SIFT_API_KEY": KEYS[0]["key"], "COLUMNS": "200",
                           "NO_COLOR": "1"}  # fmt: skip


@pytest.mark.timeout(180)
def test_sift_ingest_says_how_many_documents_a_later_write_left_unwritten(tmp_path: Path) -> None:
    holds = tmp_path / "holds"
    holds.mkdir()
    # one id twice: the second line's request is sent once the first one's job is final
    rows = [{"id": "hold-ingest-a", "text": "voided by the drop"},
            {"id": "hold-ingest-a", "text": "sent after the drop"}]  # fmt: skip
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with holding_stack(tmp_path, holds) as (client, cli_env):
        results: list[Result] = []
        args = ["ingest", str(corpus), "--index", INDEX, "--batch-size", "1", "--json"]
        sift = threading.Thread(
            target=lambda: results.append(CliRunner().invoke(app, args, env=cli_env))
        )
        sift.start()
        try:  # the first line's job runs, held before it embeds; the drop comes after it
            wait_for(lambda: any(holds.glob("hit-ingest-*")), "the first ingest held", 60)
            dropped = client.delete(f"/v1/indexes/{INDEX}", params={"wait": 20}, headers=ACME)
            assert dropped.json()["status"] == "succeeded", dropped.text
        finally:
            (holds / "release").touch()
            sift.join(120)
        stored = client.get(f"/v1/indexes/{INDEX}/documents", headers=ACME).json()
    (result,) = results
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "1 document(s) not written: a write accepted after theirs holds their ids" in said, said
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["indexed"] == 1 and summary.get("not_written") == 1, summary
    assert [doc["text_preview"] for doc in stored["documents"]] == ["sent after the drop"], stored


@pytest.mark.timeout(180)
def test_a_delete_that_voided_an_index_s_first_ingest_succeeds(tmp_path: Path) -> None:
    """``sift documents delete`` and ``sift index delete`` of an index whose first ingest is
    accepted and held (not yet written): each job succeeds with 0 deleted and voids it, and
    the command says so, exit 0; it said the index did not exist, exit 1, ``--json``
    printing nothing. A drop of it again (the first drop voided it) and a name nobody
    wrote still say the index does not exist."""
    holds = tmp_path / "holds"
    holds.mkdir()
    with holding_stack(tmp_path, holds) as (client, cli_env):
        docs = [{"id": "hold-ingest-a", "text": "held"}, {"id": "b", "text": "held too"}]
        held = client.post(f"/v1/indexes/{INDEX}/documents", json={"documents": docs},
                           headers=ACME)  # fmt: skip
        assert held.status_code == 202, held.text
        wait_for(lambda: any(holds.glob("hit-ingest-*")), "the ingest held", 60)
        try:
            runs = [
                CliRunner().invoke(app, args, env=cli_env)
                for args in (
                    ["documents", "delete", "b", "--index", INDEX],
                    ["index", "delete", INDEX, "--yes", "--json"],
                    ["index", "delete", INDEX, "--yes"],
                    ["index", "delete", "nobody", "--yes"],
                )
            ]
        finally:
            (holds / "release").touch()
        wait_for(
            lambda: client.get(f"/v1/ingestions/{held.json()['id']}", headers=ACME).json()[
                "status"] == "succeeded", "the held ingest done", 60,
        )  # fmt: skip
    by_ids, dropped, again, typo = runs
    for run in (by_ids, dropped):
        said = " ".join(run.output.split())
        assert run.exit_code == 0, run.output
        assert (
            f"deleted 0 document(s) from index {INDEX}: none was written yet; 1 ingest job(s) "
            "of the index accepted before it write none of what it deleted"
        ) in said, said
    assert json.loads(dropped.stdout)["deleted"] == 0, dropped.stdout
    for run, name in ((again, INDEX), (typo, "nobody")):
        assert run.exit_code == 1, run.output
        assert f"index '{name}' does not exist" in run.output, run.output
