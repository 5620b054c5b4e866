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
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from tests.reliability.support import ACME, KEYS, wait_for
from tests.services import celery_worker, gateway, redis_server
from worker.cli import app

pytestmark = pytest.mark.integration

INDEX = "voided"


@pytest.mark.timeout(180)
def test_sift_ingest_says_how_many_documents_a_later_write_left_unwritten(tmp_path: Path) -> None:
    holds = tmp_path / "holds"
    holds.mkdir()
    # one id twice: the second line's request is sent once the first one's job is final
    rows = [{"id": "hold-ingest-a", "text": "voided by the drop"},
            {"id": "hold-ingest-a", "text": "sent after the drop"}]  # fmt: skip
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with redis_server(tmp_path / "redis") as url:
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_API_KEYS": json.dumps(KEYS),
               "SIFT_RUNTIME_FACTORY": "tests.reliability.holding_runtime:build_runtime",
               "HOLD_DIR": str(holds)}  # fmt: skip
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=60) as client,
            celery_worker(tmp_path / "w", env, "w"),
        ):
            results: list[Result] = []
            cli_env = {"SIFT_URL": base, "SIFT_API_KEY": KEYS[0]["key"], "COLUMNS": "200",
                       "NO_COLOR": "1"}  # fmt: skip
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
