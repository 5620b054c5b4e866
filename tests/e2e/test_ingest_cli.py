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

from tests.e2e.conftest import ACME, KEYS, Stack
from tests.services import gateway
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
    # each line's write counted, the index holding 2: the summary says why ("indexed 3
    # document(s)" alone read as 3 documents in the index)
    output = " ".join(result.output.split())
    assert "indexed 3 document(s)" in output, output
    assert "1 line(s) repeated an earlier line's id and replaced it: 2 distinct id(s)" in output
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


def test_a_request_over_the_gateways_body_limit_is_sent_in_halves(
    stack: Stack, tmp_path: Path
) -> None:
    """Every document within its 100,000 characters, the default ``--batch-size`` (500) of
    them is up to 50 MB of JSON, over the gateway's ``SIFT_MAX_BODY_BYTES`` (32 MiB): ``sift
    ingest`` of such a corpus stopped at its first request with "the gateway answered 413",
    which named no option. A request answered 413 is now sent again in halves, down to one
    document, and a document that alone is over the limit is named. Here a gateway of the
    stack's Redis (its worker) with a 64 KiB limit, and 20 KB documents."""
    env = {
        "SIFT_API_KEYS": json.dumps(KEYS),
        "SIFT_REDIS_URL": stack.redis_url + "/0",
        "SIFT_MAX_BODY_BYTES": "65536",
    }
    rows = [{"id": f"big{i}", "text": f"capybara {i} " + "x" * 20_000} for i in range(12)]
    corpus = write_jsonl(tmp_path / "big.jsonl", rows)
    huge = write_jsonl(tmp_path / "huge.jsonl", [{"id": "huge", "text": "y" * 70_000}])
    key = ACME["Authorization"].split()[1]
    with gateway(tmp_path / "g", env, "small") as url:
        cli_env = {"SIFT_URL": url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
        result = CliRunner().invoke(app, ["ingest", str(corpus), "--index", "cli-split"],
                                    env=cli_env)  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "indexed 12 document(s)" in result.output, result.output
        refused = CliRunner().invoke(app, ["ingest", str(huge), "--index", "cli-split"],
                                     env=cli_env)  # fmt: skip
    assert refused.exit_code == 1, refused.output
    assert "'huge'" in refused.output and "SIFT_MAX_BODY_BYTES" in refused.output, refused.output
    shown = stack.live.get("/v1/indexes/cli-split", headers=ACME)
    assert shown.status_code == 200 and shown.json()["documents"] == 12, shown.text


def test_a_stopped_ingest_says_what_was_indexed_and_the_line_to_resume_from(
    stack: Stack, tmp_path: Path
) -> None:
    """``sift ingest`` stopped by a refused request (here a document alone over the body
    limit, after its request's first half was indexed) said only why: not how many documents
    were in, nor from which line to send the rest. The error now says both, and that sending
    the whole file again is safe: an ingest replaces documents by id."""
    env = {
        "SIFT_API_KEYS": json.dumps(KEYS),
        "SIFT_REDIS_URL": stack.redis_url + "/0",
        "SIFT_MAX_BODY_BYTES": "65536",
    }
    small = [json.dumps({"id": f"r{i}", "text": f"wombat burrow {i}"}) for i in range(1, 6)]
    huge = json.dumps({"id": "huge", "text": "y" * 70_000})
    corpus = tmp_path / "stops.jsonl"  # line 3 blank: the line numbers are the file's
    corpus.write_text("\n".join([*small[:2], "", *small[2:4], huge, small[4]]) + "\n")
    key = ACME["Authorization"].split()[1]
    with gateway(tmp_path / "g", env, "small") as url:
        cli_env = {"SIFT_URL": url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
        # requests [r1 r2 r3] and [r4 huge r5]: the second is 413, then [r4] goes in, then
        # [huge r5] and [huge] are 413 again
        stopped = CliRunner().invoke(app, ["ingest", str(corpus), "--index", "cli-resume",
                                           "--batch-size", "3"], env=cli_env)  # fmt: skip
        as_json = CliRunner().invoke(app, ["ingest", str(corpus), "--index", "cli-resume-json",
                                           "--batch-size", "3", "--json"], env=cli_env)  # fmt: skip
    assert stopped.exit_code == 1, stopped.output
    output = " ".join(stopped.output.split())
    assert "'huge' alone is larger" in output, output
    assert f"4 of 6 document(s) of {corpus} known indexed, all those before line 6" in output
    assert "resume from line 6 (document 'huge') with --from-line 6" in output, output
    assert "send the whole file again" in output, output
    # --json: the same, as one object on stdout (the error and the note still on stderr)
    assert as_json.exit_code == 1, as_json.output
    summary = json.loads(as_json.stdout)
    assert summary["status"] == "failed" and "'huge' alone is larger" in summary["error"]
    assert (summary["documents"], summary["known_indexed"]) == (6, 4), summary
    assert summary["not_known_indexed"] == 2 and summary["resume_from_line"] == 6, summary
    assert len(summary["jobs"]) == 2 and summary["sent"] == 4, summary  # [r1 r2 r3], [r4]
    listed = stack.live.get("/v1/indexes/cli-resume/documents", headers=ACME)
    assert sorted(d["id"] for d in listed.json()["documents"]) == ["r1", "r2", "r3", "r4"]
    again = sift(stack, "ingest", str(corpus), "--index", "cli-resume")  # the 32 MiB limit
    assert again.exit_code == 0, again.output
    listed = stack.live.get("/v1/indexes/cli-resume/documents", headers=ACME)
    assert sorted(d["id"] for d in listed.json()["documents"]) == [
        "huge", "r1", "r2", "r3", "r4", "r5"
    ]  # fmt: skip


def test_a_blank_text_stops_the_command_before_anything_is_sent(
    stack: Stack, tmp_path: Path
) -> None:
    """The gateway refuses a document with no visible character (whitespace, a zero-width
    space, a soft hyphen, a BOM): ``sift ingest`` let it through its own checks, so the
    lines before it were sent and the command stopped part-way on the gateway's 422."""
    for n, text in enumerate((" \t\n", "\u200b", "\u00ad\ufeff")):
        index = f"cli-blank-{n}"
        rows = [{"id": "ok", "text": "a good line"}, {"id": "bad", "text": text}]
        corpus = write_jsonl(tmp_path / f"b{n}.jsonl", rows)
        result = sift(stack, "ingest", str(corpus), "--index", index, "--batch-size", "1")
        assert result.exit_code == 1, (text, result.output)
        assert f"b{n}.jsonl:2: field 'text'" in result.output, result.output
        assert "nothing was sent" in result.output
        gone = stack.live.get(f"/v1/indexes/{index}", headers=ACME)
        assert gone.status_code == 404, (text, gone.text)


def test_a_dot_segment_id_stops_the_command_before_anything_is_sent(
    stack: Stack, tmp_path: Path
) -> None:
    """The gateway refuses an id with a ``.`` or ``..`` part between slashes (a client
    resolves them in a URL: ``DELETE .../documents/..`` is the index's own ``DELETE``, and
    ``.../documents/a/../b`` is document ``b``'s); ``sift ingest`` names the line, a BEIR one
    by its ``_id``."""
    rows = ({"id": ".", "text": "one dot"}, {"_id": "..", "text": "two"}, {"id": "a/../b"})
    for n, row in enumerate({**row, "text": "t"} for row in rows):
        index = f"cli-dots-{n}"
        corpus = write_jsonl(tmp_path / f"d{n}.jsonl", [{"id": "ok", "text": "a good line"}, row])
        result = sift(stack, "ingest", str(corpus), "--index", index, "--batch-size", "1")
        assert result.exit_code == 1, (row, result.output)
        field = "_id" if "_id" in row else "id"
        assert f"d{n}.jsonl:2: field '{field}'" in result.output, result.output
        assert "nothing was sent" in result.output
        gone = stack.live.get(f"/v1/indexes/{index}", headers=ACME)
        assert gone.status_code == 404, (row, gone.text)


def test_from_line_sends_the_file_from_that_line_on(stack: Stack, tmp_path: Path) -> None:
    """The resume line had no option to go on from it: the whole file was to be sent again.
    ``--from-line N`` sends the documents of line N on; the lines before it are not read as
    documents (a bad one among them, sent or skipped by the run before, does not stop it),
    and a line number said is still the file's."""
    corpus = tmp_path / "from.jsonl"
    corpus.write_text(
        json.dumps({"id": "f1", "text": "quokka one"}) + "\n"
        + "not json, sent or skipped by the run before\n"
        + "\n"  # line 3 blank
        + "".join(json.dumps({"id": f"f{i}", "text": f"quokka {i}"}) + "\n" for i in (4, 5))
    )  # fmt: skip
    result = sift(stack, "ingest", str(corpus), "--index", "cli-from", "--from-line", "3")
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "indexed 2 document(s)" in output and "from line 3" in output, output
    listed = stack.live.get("/v1/indexes/cli-from/documents", headers=ACME)
    assert sorted(d["id"] for d in listed.json()["documents"]) == ["f4", "f5"]
    past = sift(stack, "ingest", str(corpus), "--index", "cli-from", "--from-line", "6")
    assert past.exit_code == 1, past.output
    assert "no documents to send from line 6" in " ".join(past.output.split()), past.output


def test_json_prints_the_summary_as_one_object(stack: Stack, tmp_path: Path) -> None:
    """``sift ingest`` had no ``--json``, unlike the other commands: a script read the
    counts off the summary's words. With it, stdout is one JSON object (the progress bar
    goes to stderr)."""
    rows = [
        {"id": "j1", "text": "the old text of j1"},
        {"id": "j2", "text": "j2 stays"},
        {"id": "j1", "text": "the new text of j1"},
    ]
    corpus = write_jsonl(tmp_path / "j.jsonl", rows)
    result = sift(stack, "ingest", str(corpus), "--index", "cli-json", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["status"] == "succeeded" and summary["error"] is None, summary
    assert summary["index"] == "cli-json" and summary["file"] == str(corpus), summary
    assert (summary["documents"], summary["sent"], summary["indexed"]) == (3, 3, 3), summary
    assert (summary["known_indexed"], summary["not_known_indexed"]) == (3, 0), summary
    assert (summary["repeated_ids"], summary["distinct_ids"]) == (1, 2), summary
    assert summary["skipped_invalid"] == 0 and summary["from_line"] == 1, summary
    assert summary["resume_from_line"] is None and summary["unsettled_jobs"] == [], summary
    assert len(summary["jobs"]) == 2, summary  # the repeated id started a second request
    for job in summary["jobs"]:
        got = stack.live.get(f"/v1/ingestions/{job}", headers=ACME)
        assert got.status_code == 200 and got.json()["status"] == "succeeded", got.text
