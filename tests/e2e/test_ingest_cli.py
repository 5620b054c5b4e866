"""``sift ingest`` over the real stack (the CLI in-process through typer's runner, the
gateway and worker as processes): what the gateway refuses in a request, the CLI does not
send.

The gateway takes an id once per request and refuses metadata no backend can hold (keys
outside ``[A-Za-z0-9_.:-]``, NaN, integers past 64 bits, lone surrogates). ``sift ingest``
checked its lines with the looser ``DocumentIn``: a file repeating an id within one request's
worth of lines (the CLI's own rule: its last line wins) stopped with a 422 part-way, and a
line with such metadata was found only when its request was refused, after the lines before
it were loaded, although a bad line is to stop the command before anything is sent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

from tests.e2e.conftest import ACME, Stack
from worker.cli import app


def sift(stack: Stack, *args: str) -> Result:
    key = ACME["Authorization"].split()[1]
    env = {"SIFT_URL": stack.live_url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
    return CliRunner().invoke(app, list(args), env=env)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_repeated_id_in_one_request_keeps_its_last_line(stack: Stack, tmp_path: Path) -> None:
    rows = [
        {"id": "r1", "text": "the old text of r1"},
        {"id": "r2", "text": "r2 stays"},
        {"id": "r1", "text": "the new text of r1"},
    ]
    result = sift(stack, "ingest", str(write_jsonl(tmp_path / "c.jsonl", rows)),
                  "--index", "cli-repeat")  # fmt: skip
    assert result.exit_code == 0, result.output
    got = stack.live.get("/v1/indexes/cli-repeat/documents/r1", headers=ACME)
    assert got.status_code == 200, got.text
    assert got.json()["text"] == "the new text of r1"
    shown = stack.live.get("/v1/indexes/cli-repeat", headers=ACME)
    assert shown.json()["documents"] == 2, shown.text


def test_metadata_the_gateway_refuses_stops_the_command_before_anything_is_sent(
    stack: Stack, tmp_path: Path
) -> None:
    for n, metadata in enumerate(
        ({"a b": "x"}, {"year": float("nan")}, {"big": 2**64}, {"k": "\ud800"})
    ):
        index = f"cli-refused-{n}"
        rows = [{"id": "ok", "text": "a good line", "metadata": {"lang": "en"}},
                {"id": "bad", "text": "a bad line", "metadata": metadata}]  # fmt: skip
        corpus = tmp_path / f"c{n}.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))  # NaN, \ud800 as JSON
        result = sift(stack, "ingest", str(corpus), "--index", index, "--batch-size", "1")
        assert result.exit_code == 1, (metadata, result.output)
        assert f"c{n}.jsonl:2: field 'metadata" in result.output, result.output
        assert "nothing was sent" in result.output
        gone = stack.live.get(f"/v1/indexes/{index}", headers=ACME)
        assert gone.status_code == 404, (metadata, gone.text)
