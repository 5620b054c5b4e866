"""``sift indexes``, ``sift index show|delete``, ``sift documents list|get|delete`` over the real
stack (the CLI in-process through typer's runner, the gateway and worker as processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

from tests.e2e.conftest import ACME, Stack, ingest
from worker.cli import app

DOCS = [
    {"id": "c1", "title": "Okapi", "text": "okapi forest giraffe", "metadata": {"zone": "ituri"}},
    {"id": "c2", "title": "Pangolin", "text": "pangolin scales keratin"},
    {"id": "c3", "title": "Axolotl", "text": "axolotl regrows limbs"},
]


def sift(stack: Stack, *args: str, stdin: str | None = None) -> Result:
    key = ACME["Authorization"].split()[1]
    env = {"SIFT_URL": stack.live_url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
    return CliRunner().invoke(app, list(args), env=env, input=stdin)


def _json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_indexes_and_index_show(stack: Stack) -> None:
    ingest(stack, "cli-list", DOCS)
    listed = {i["name"]: i for i in _json(sift(stack, "indexes", "--json"))}
    assert listed["cli-list"]["documents"] == 3 and listed["cli-list"]["backend"] == "embedded"
    table = sift(stack, "indexes")
    assert table.exit_code == 0 and "cli-list" in table.stdout and "embedded" in table.stdout
    shown = _json(sift(stack, "index", "show", "cli-list", "--json"))
    assert shown == listed["cli-list"]
    missing = sift(stack, "index", "show", "cli-nobody")
    assert missing.exit_code == 1 and "does not exist" in missing.output


def test_documents_get_and_delete(stack: Stack) -> None:
    ingest(stack, "cli-docs", DOCS)
    doc = _json(sift(stack, "documents", "get", "c1", "--index", "cli-docs", "--json"))
    assert doc["text"] == "okapi forest giraffe" and doc["metadata"] == {"zone": "ituri"}
    shown = sift(stack, "documents", "get", "c1", "--index", "cli-docs")
    assert shown.exit_code == 0 and "okapi forest giraffe" in shown.stdout
    gone = sift(stack, "documents", "delete", "c1", "c2", "--index", "cli-docs")
    assert gone.exit_code == 0, gone.output
    assert "deleted 2 document(s)" in gone.stdout
    # --json is the summary with its jobs whatever the count of ids (it was the one job's
    # answer up to 1,000 ids, the summary above)
    summary = _json(
        sift(stack, "documents", "delete", "c3", "nope", "--index", "cli-docs", "--json")
    )
    assert summary["status"] == "succeeded" and summary["deleted"] == 1, summary
    [job] = summary["jobs"]
    assert job["operation"] == "delete" and job["deleted"] == 1 and job["documents"] == 2, job
    after = sift(stack, "documents", "get", "c1", "--index", "cli-docs")
    assert after.exit_code == 1 and "404" in after.output


def test_documents_delete_sends_each_id_once(stack: Stack) -> None:
    """An id given twice is sent once: the ids were cut into jobs of 1,000 as given, so an id
    given again past the first 1,000 made a job of its own that deleted nothing (1,000 ids
    given twice: a second job of 1,000, deleting none)."""
    ingest(stack, "cli-twice", DOCS)
    ids = ["c1", *(f"none-{i}" for i in range(998)), "c2", "c1", "c2"]  # 1,002 given, 1,000 ids
    summary = _json(sift(stack, "documents", "delete", *ids, "--index", "cli-twice", "--json"))
    assert summary["status"] == "succeeded" and summary["deleted"] == 2, summary
    [job] = summary["jobs"]
    assert job["documents"] == 1_000 and job["deleted"] == 2, job


def test_every_id_and_name_is_one_path_segment(stack: Stack, tmp_path: Path) -> None:
    """The CLI put an index name into the path as typed, and a document id percent-encoded
    but for its dots, which the HTTP client then resolved as ``.``/``..`` segments: ``sift
    documents get .. --index X`` read the index itself (a ``KeyError`` traceback), and
    ``sift index delete X/documents/c1 --yes`` deleted document ``c1`` of ``X`` (the gateway
    routes on the decoded path, so an encoded ``/`` does not help: a name is checked first).
    The gateway now refuses the ids ``.`` and ``..`` at ingest; one stored before is still
    read by its own path: here, none is stored, so the read is the document's 404, not the
    index (or its document list) read in its place."""
    ingest(stack, "cli-dots", DOCS)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "c9", "text": "never sent"}) + "\n")
    for dots in (".", ".."):
        missing = sift(stack, "documents", "get", dots, "--index", "cli-dots", "--json")
        assert missing.exit_code == 1, missing.output
        assert "404" in missing.output and "Traceback" not in missing.output, missing.output
    for args in (
        ("index", "delete", "cli-dots/documents/c1", "--yes"),
        ("index", "show", "cli-dots/documents/c1"),
        ("documents", "get", "c1", "--index", "cli-dots/documents/c2"),
        ("documents", "delete", "c1", "--index", "cli-dots/documents/c2"),
        ("ingest", str(corpus), "--index", ".."),
        # Python's "$" matches before a last line break: the name was sent, and refused there
        ("index", "delete", "cli-dots\n", "--yes"),
    ):
        refused = sift(stack, *args)  # a usage error naming the option, nothing sent
        assert refused.exit_code == 2, (args, refused.output)
        assert "is not an index name" in refused.output, (args, refused.output)
    assert _json(sift(stack, "index", "show", "cli-dots", "--json"))["documents"] == 3


def test_index_delete_asks_first(stack: Stack) -> None:
    ingest(stack, "cli-drop", DOCS)
    declined = sift(stack, "index", "delete", "cli-drop", stdin="n\n")
    assert declined.exit_code != 0
    assert _json(sift(stack, "index", "show", "cli-drop", "--json"))["documents"] == 3
    confirmed = sift(stack, "index", "delete", "cli-drop", stdin="y\n")
    assert confirmed.exit_code == 0 and "deleted 3 document(s)" in confirmed.stdout
    assert sift(stack, "index", "show", "cli-drop").exit_code == 1
    again = sift(stack, "index", "delete", "cli-drop", "--yes", "--json")
    assert again.exit_code == 1 and "index 'cli-drop' does not exist" in again.output, again.output


def test_deletes_on_an_index_nobody_has_say_it_does_not_exist(stack: Stack) -> None:
    """Every command names an index that does not exist (exit 1) but the two deletes, which
    said ``deleted 0 document(s)``, exit 0: a typo's delete passed for done."""
    ingest(stack, "cli-known", DOCS)
    for args in (
        ("index", "delete", "cli-unknown", "--yes"),
        ("index", "delete", "cli-unknown", "--yes", "--json"),
        ("documents", "delete", "c1", "--index", "cli-unknown"),
        ("documents", "delete", "c1", "--index", "cli-unknown", "--json"),
    ):
        missing = sift(stack, *args)
        assert missing.exit_code == 1, (args, missing.output)
        assert "index 'cli-unknown' does not exist" in missing.stderr, (args, missing.output)
        assert missing.stdout == "", (args, missing.output)
    # an index that exists, none of whose ids is there: 0 deleted is the truth, exit 0
    none = sift(stack, "documents", "delete", "nope", "--index", "cli-known")
    assert none.exit_code == 0 and "deleted 0 document(s)" in none.stdout, none.output


def test_documents_list_pages_through_escapes_markup_and_lists_all(stack: Stack) -> None:
    docs = [
        {"id": f"m{n:02d}", "title": f"[red]t{n}[/]", "text": f"[bold]text {n}[/] " + "w " * 80}
        for n in range(12)
    ]
    response = stack.live.post(
        "/v1/indexes/cli-list-docs/documents",
        params={"wait": 20},
        json={"documents": docs},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    first = _json(sift(stack, "documents", "list", "cli-list-docs", "--limit", "5", "--json"))
    assert [d["id"] for d in first] == ["m00", "m01", "m02", "m03", "m04"]
    assert "vector" not in first[0] and first[0]["text_length"] == len(docs[0]["text"])
    every = _json(sift(stack, "documents", "list", "cli-list-docs", "--all", "--json"))
    assert [d["id"] for d in every] == [d["id"] for d in docs]
    table = sift(stack, "documents", "list", "cli-list-docs", "--limit", "3")
    assert table.exit_code == 0, table.output
    assert "3 documents of 12 in cli-list-docs" in table.stdout
    assert "[red]t0[/]" in table.stdout and "[bold]text 0[/]" in table.stdout  # not markup
    assert "more documents follow" in table.stdout and "m03" not in table.stdout
    whole = sift(stack, "documents", "list", "cli-list-docs", "--all")
    assert whole.exit_code == 0 and "12 documents of 12" in whole.stdout and "m11" in whole.stdout
    assert "more documents follow" not in whole.stdout
    both = sift(stack, "documents", "list", "cli-list-docs", "--all", "--limit", "2")
    assert both.exit_code == 2 and "'--limit' / '--all'" in both.output
    missing = sift(stack, "documents", "list", "cli-nobody")
    assert missing.exit_code == 1 and "does not exist" in missing.output


# a stored document that tries to drive the terminal: set its title and clipboard (OSC 0 and
# 52), clear the screen and print a fake line (CSI), a hyperlink whose text lies (OSC 8), a
# carriage return over the line, a C1 CSI (0x9b) and a right-to-left override
HOSTILE_ID = "evil\x1b[31m-id"
HOSTILE_TITLE = "Chess \x1b]0;PWNED\x07\x1b]52;c;Y3VybA==\x07 \u202eelif"
HOSTILE_TEXT = (
    "Deep Blue beat Kasparov at chess.\n\x1b[2J\x1b[H\x1b[32mAll checks passed\x1b[0m "
    "\x1b]8;;https://evil.example/\x1b\\https://docs.example/\x1b]8;;\x1b\\ ok\rFAILED \x9b2J"
)
CONTROLS = ("\x1b", "\x07", "\r", "\x9b", "\u202e")


def test_stored_control_characters_are_shown_escaped_and_json_is_exact(stack: Stack) -> None:
    """Every stored text the CLI prints to a terminal has its control characters and bidi
    overrides shown as escapes (``\\x1b``, ``\\u202e``): none reaches the terminal raw. The
    text's own newline stays a newline in ``documents get``; ``--json`` is the text exact."""
    doc = {
        "id": HOSTILE_ID,
        "title": HOSTILE_TITLE,
        "text": HOSTILE_TEXT,
        "metadata": {"m": "\x9b"},
    }
    response = stack.live.post(
        "/v1/indexes/cli-controls/documents",
        params={"wait": 20},
        json={"documents": [doc]},
        headers=ACME,
    )
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
    commands = {
        "search": (
            "search",
            "kasparov chess \x1b]0;Q\x07",
            "--index",
            "cli-controls",
            "--mode",
            "fts",
        ),
        "get": ("documents", "get", HOSTILE_ID, "--index", "cli-controls"),
        "list": ("documents", "list", "cli-controls"),
        "searches": ("searches", "--limit", "1"),
    }
    shown = {name: sift(stack, *args) for name, args in commands.items()}
    for name, result in shown.items():
        assert result.exit_code == 0, (name, result.output)
        raw = [c for c in CONTROLS if c in result.output]
        assert not raw, (name, raw, result.output)
    assert r"evil\x1b[31m-id" in shown["get"].stdout
    assert r"Chess \x1b]0;PWNED\x07\x1b]52;c;Y3VybA==\x07 \u202eelif" in shown["get"].stdout
    assert "Deep Blue beat Kasparov at chess.\n" in shown["get"].stdout  # its line, kept
    assert r"\x1b[2J\x1b[H\x1b[32mAll checks passed\x1b[0m" in shown["get"].stdout
    assert r"ok\rFAILED \x9b2J" in shown["get"].stdout
    assert r'"m": "\x9b"' in shown["get"].stdout
    assert r"evil\x1b[31m-id" in shown["search"].stdout
    assert r"evil\x1b[31m-id" in shown["list"].stdout
    assert r"\x1b[2J" in shown["list"].stdout  # the preview, on one line
    assert r"kasparov chess \x1b]0;Q\x07" in shown["searches"].stdout
    exact = _json(sift(stack, "documents", "get", HOSTILE_ID, "--index", "cli-controls", "--json"))
    assert (exact["id"], exact["title"], exact["text"]) == (HOSTILE_ID, HOSTILE_TITLE, HOSTILE_TEXT)
    listed = _json(sift(stack, "documents", "list", "cli-controls", "--json"))
    assert listed[0]["id"] == HOSTILE_ID and listed[0]["title"] == HOSTILE_TITLE


def test_ingestions_tell_an_ingest_a_delete_and_a_drop_apart(stack: Stack) -> None:
    """``sift ingestions`` showed documents and upserted only: a drop of 3 documents read
    "documents 0, upserted –", the same as an ingest that had not run."""
    ingest(stack, "cli-ops", DOCS)
    assert sift(stack, "documents", "delete", "c1", "c2", "--index", "cli-ops").exit_code == 0
    assert sift(stack, "index", "delete", "cli-ops", "--yes").exit_code == 0
    table = sift(stack, "ingestions", "--limit", "3")
    assert table.exit_code == 0, table.output
    rows = [line.split() for line in table.stdout.splitlines() if "cli-ops" in line]
    # operation, index, documents, upserted, deleted; newest first
    assert [row[2:7] for row in rows] == [
        ["drop", "cli-ops", "0", "–", "1"],
        ["delete", "cli-ops", "2", "–", "2"],
        ["upsert", "cli-ops", "3", "3", "–"],
    ], table.stdout
