"""The listing commands' paging: short filtered pages are followed by their token past the
limit, and ``--limit`` + 1 is sent as the page size (at most the gateway's maximum), the one
more telling whether more follow."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from worker.cli._http import Gateway
from worker.cli.listing import fetch_jobs
from worker.constants import MAX_PAGE_SIZE


def gateway_of(pages: list[dict[str, Any]], seen: list[dict[str, str]]) -> Gateway:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.url.params))
        return httpx.Response(200, json=pages[len(seen) - 1])

    return Gateway("http://gw", "key", transport=httpx.MockTransport(answer))


JOB: dict[str, Any] = {
    "id": "srch_0123456789abcdef0123456789abcdef", "status": "succeeded",
    "index": "scifact", "mode": "hybrid", "query": "0-dimensional biomaterials show "
    "inductive properties", "created_at": "2026-12-01T23:15:08+00:00",
    "finished_at": "2026-12-01T23:15:09+00:00", "error": None,
}  # fmt: skip


def list_searches(monkeypatch: Any, job: dict[str, Any], env: dict[str, str | None]) -> Any:
    """``sift searches`` run with ``env``, against a gateway that lists ``job`` alone."""
    import contextlib

    from typer.testing import CliRunner

    from worker.cli import app, listing

    @contextlib.contextmanager
    def fake_gateway() -> Any:
        yield gateway_of([{"searches": [job], "next_page_token": None}], [])

    monkeypatch.setattr(listing, "gateway", fake_gateway)
    return CliRunner().invoke(app, ["searches"], env=env)


def test_short_filtered_pages_are_followed_to_the_limit() -> None:
    pages = [
        {"batches": [], "next_page_token": "t1"},  # the scan bound: nothing matched yet
        {"batches": [{"id": "b1"}], "next_page_token": "t2"},
        {"batches": [{"id": "b2"}, {"id": "b3"}], "next_page_token": "t3"},
    ]
    seen: list[dict[str, str]] = []
    jobs, _ = fetch_jobs(gateway_of(pages, seen), "/v1/batches", "batches", "failed", 2)
    assert [j["id"] for j in jobs] == ["b1", "b2"]
    assert seen == [
        {"page_size": "3", "status": "failed"},
        {"page_size": "3", "status": "failed", "page_token": "t1"},
        {"page_size": "3", "status": "failed", "page_token": "t2"},
    ]


def test_more_is_said_only_when_a_job_past_the_limit_was_seen() -> None:
    """A filtered page that fills up carries a token though nothing may match past it (the
    gateway does not read ahead): "more follow" must come from a job seen past the limit,
    not from the token. Before, exactly ``limit`` matches said "more follow", and the token
    led to an empty last page."""
    pages = [
        {"batches": [{"id": "b1"}, {"id": "b2"}], "next_page_token": "t1"},
        {"batches": [], "next_page_token": None},
    ]
    seen: list[dict[str, str]] = []
    jobs, more = fetch_jobs(gateway_of(pages, seen), "/v1/batches", "batches", "canceled", 2)
    assert ([j["id"] for j in jobs], more) == (["b1", "b2"], False)
    pages = [
        {"batches": [{"id": "b1"}, {"id": "b2"}], "next_page_token": "t1"},
        {"batches": [{"id": "b3"}], "next_page_token": None},
    ]
    jobs, more = fetch_jobs(gateway_of(pages, []), "/v1/batches", "batches", "canceled", 2)
    assert ([j["id"] for j in jobs], more) == (["b1", "b2"], True)


def test_the_list_ends_at_a_null_token_and_the_page_size_is_capped() -> None:
    pages = [{"searches": [{"id": "s1"}], "next_page_token": None}]
    seen: list[dict[str, str]] = []
    jobs, _ = fetch_jobs(gateway_of(pages, seen), "/v1/searches", "searches", None, 5000)
    assert [j["id"] for j in jobs] == ["s1"]
    assert seen == [{"page_size": str(MAX_PAGE_SIZE)}]


def test_at_80_columns_whole_cells_are_shown_and_what_did_not_fit_is_named(
    monkeypatch: Any,
) -> None:
    """A narrow terminal gets whole ids and statuses (to copy and read), fewer columns, and a
    line naming the ones left out; a wide one gets every column."""
    job = dict(JOB)
    narrow = list_searches(monkeypatch, job, {"COLUMNS": "80"})
    assert narrow.exit_code == 0, narrow.output
    assert max(len(line) for line in narrow.output.splitlines()) <= 80
    assert job["id"] in narrow.output and "succeeded" in narrow.output and "…" not in narrow.output
    assert "left out at this width: finished, mode, index (--json has all)" in narrow.output
    wide = list_searches(monkeypatch, job, {"COLUMNS": "200"})
    assert "left out" not in wide.output
    assert all(word in wide.output for word in ("hybrid", "scifact", "inductive properties"))


@pytest.mark.parametrize("columns", [40, 45, 50, 55, 60, 64])
def test_below_the_droppable_columns_nothing_is_cut_or_lost_unnamed(
    monkeypatch: Any, columns: int
) -> None:
    """Narrower than the columns no drop can spare: the query (a wrapped column) was squeezed
    under its least width and then out of sight at 50 columns, named nowhere, and the id and
    status cut with no mark ('…abcde', 'succeede'): an id that reads whole and is not. Now
    a wrapped column goes too, named, and a cell that cannot fit ends in '…'."""
    job = {**JOB, "query": "0-dimensional biomaterials", "finished_at": None}
    shown = list_searches(monkeypatch, job, {"COLUMNS": str(columns)})
    assert shown.exit_code == 0, shown.output
    table, note = shown.output.split("left out at this width:")
    assert max(len(line) for line in table.splitlines()) <= columns
    note = " ".join(note.split())
    assert ("query" in table) != ("query" in note), shown.output
    if "query" in table:
        assert "biomaterials" in table.replace("\n", "")  # whole, if wrapped
    row = next(line for line in table.splitlines() if "srch_" in line)
    if job["id"] not in row:
        assert "…" in row, shown.output  # cut, and marked so
    else:
        assert "succeeded" in row or "…" in row, shown.output


def test_written_to_a_pipe_the_note_says_the_width_is_a_pipes(monkeypatch: Any) -> None:
    """Piped (``sift searches | less``) or redirected, rich takes 80 columns however wide the
    terminal: "left out at this width" pointed at a width the user never had."""
    monkeypatch.delenv("COLUMNS", raising=False)
    piped = list_searches(monkeypatch, dict(JOB), {"COLUMNS": None})
    assert piped.exit_code == 0, piped.output
    note = " ".join(piped.output.split("left out")[1].split())
    assert note.startswith("at 80 columns, the width when the output is not a terminal:"), note
    assert "COLUMNS=200 shows more" in note


@pytest.mark.parametrize(
    ("command", "jobs", "args", "title"),
    [
        ("searches", 1, [], "1 search, newest first"),
        ("searches", 2, [], "2 searches, newest first"),
        ("batches", 1, ["--status", "failed"], "1 failed batch, newest first"),
        ("batches", 0, ["--status", "failed"], "0 failed batches, newest first"),
        ("ingestions", 1, [], "1 ingestion, newest first"),
        ("ingestions", 3, [], "3 ingestions, newest first"),
    ],
)
def test_the_title_counts_in_the_singular_for_one(
    monkeypatch: Any, command: str, jobs: int, args: list[str], title: str
) -> None:
    """The title read "1 searches"."""
    import contextlib

    from typer.testing import CliRunner

    from worker.cli import app, listing

    listed = [{**JOB, "id": f"job_{i}", "status": "failed"} for i in range(jobs)]

    @contextlib.contextmanager
    def fake_gateway() -> Any:
        yield gateway_of([{command: listed, "next_page_token": None}], [])

    monkeypatch.setattr(listing, "gateway", fake_gateway)
    shown = CliRunner().invoke(app, [command, *args], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines()[0].strip() == title, shown.output


def test_documents_are_followed_page_after_page_and_cut_at_the_limit() -> None:
    """``sift documents list``: ``--all`` follows every token at the largest page (each
    page counted for the progress bar); ``--limit`` asks for that many and says whether
    more are left, from the token or from a longer page."""
    from worker.cli.indexes import fetch_documents

    pages = [
        {"documents": [{"id": "a"}, {"id": "b"}], "next_page_token": "t1"},
        {"documents": [{"id": "c"}], "next_page_token": None},
    ]
    seen: list[dict[str, str]] = []
    counts: list[int] = []
    docs, more = fetch_documents(gateway_of(pages, seen), "docs", None, counts.append)
    assert ([d["id"] for d in docs], more, counts) == (["a", "b", "c"], False, [2, 1])
    assert seen == [{"page_size": str(MAX_PAGE_SIZE)}, {"page_size": "1000", "page_token": "t1"}]
    seen.clear()
    docs, more = fetch_documents(gateway_of(pages, seen), "docs", 2)
    assert ([d["id"] for d in docs], more) == (["a", "b"], True)
    assert seen == [{"page_size": "2"}]
    seen.clear()
    last = [{"documents": [{"id": "c"}], "next_page_token": None}]
    assert fetch_documents(gateway_of(last, seen), "docs", 1) == ([{"id": "c"}], False)


def documents_gateway(
    monkeypatch: Any, answers: list[httpx.Response], written: list[str]
) -> list[str]:
    """``sift documents list`` against a gateway that holds index ``docs`` of three documents
    and answers its document pages with ``answers`` in turn; ``written`` gets what stdout
    held when each page was asked for. Answers the paths asked."""
    import contextlib
    import sys

    from worker.cli import indexes

    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url.params))
        if request.url.path == "/v1/indexes/docs":
            return httpx.Response(200, json={"name": "docs", "documents": 3})
        sys.stdout.flush()
        written.append(sys.stdout.buffer.getvalue().decode())  # type: ignore[attr-defined]
        return answers.pop(0)

    @contextlib.contextmanager
    def fake_gateway() -> Any:
        yield Gateway("http://gw", "key", transport=httpx.MockTransport(answer))

    monkeypatch.setattr(indexes, "gateway", fake_gateway)
    return asked


DOC_PAGES = [
    {
        "documents": [{"id": "a", "metadata": {}}, {"id": "b", "metadata": {}}],
        "next_page_token": "t1",
    },
    {"documents": [{"id": "c", "metadata": {}}], "next_page_token": None},
]


def test_documents_list_all_reads_a_page_again_through_a_gateway_restart(
    monkeypatch: Any,
) -> None:
    """A page read is a GET: a 503 (no worker answered in time, Redis restarting) or a lost
    connection half-way through ``--all`` is sent again, as ``sift batch`` reads its result
    pages; it ended the command with every page read so far thrown away."""
    from typer.testing import CliRunner

    from worker.cli import app

    answers = [
        httpx.Response(200, json=DOC_PAGES[0]),
        httpx.Response(503, json={"error": {"type": "unavailable", "message": "no worker"}}),
        httpx.Response(200, json=DOC_PAGES[1]),
    ]
    asked = documents_gateway(monkeypatch, answers, [])
    shown = CliRunner().invoke(app, ["documents", "list", "docs", "--all", "--json"])
    assert shown.exit_code == 0, shown.output
    assert [d["id"] for d in json.loads(shown.stdout)] == ["a", "b", "c"]
    assert asked[-2:] == ["page_size=1000&page_token=t1"] * 2


def test_documents_list_all_json_writes_each_page_before_reading_the_next(
    monkeypatch: Any,
) -> None:
    """``--all --json`` on a big index: each page is written as it comes (one JSON array in
    the end), so memory holds a page, not the index (1,000,000 documents held as dicts are
    about a GB); and a failure half-way leaves what was read, unterminated, with exit 1."""
    from typer.testing import CliRunner

    from worker.cli import app

    written: list[str] = []
    documents_gateway(monkeypatch, [httpx.Response(200, json=p) for p in DOC_PAGES], written)
    shown = CliRunner().invoke(app, ["documents", "list", "docs", "--all", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout) == [*DOC_PAGES[0]["documents"], *DOC_PAGES[1]["documents"]]
    assert '"id": "b"' in written[1]  # page one was out before page two was asked for
    gone = {"error": {"type": "index_not_found", "message": "index 'docs' does not exist"}}
    answers = [httpx.Response(200, json=DOC_PAGES[0]), httpx.Response(404, json=gone)]
    documents_gateway(monkeypatch, answers, [])
    cut = CliRunner().invoke(app, ["documents", "list", "docs", "--all", "--json"])
    assert cut.exit_code == 1 and "does not exist" in cut.stderr
    assert cut.stdout.startswith('[{"id": "a"') and not cut.stdout.rstrip().endswith("]")


def test_a_canceled_batch_s_row_shows_its_canceled_items(monkeypatch: Any) -> None:
    """A batch canceled midway: 677 succeeded, 538 failed, 1,785 canceled. Its row read
    ``done 3000/3000``, ``failed 538`` and nothing else, as if 2,462 had succeeded."""
    import contextlib

    from typer.testing import CliRunner

    from worker.cli import app, listing

    counts = {"total": 3000, "queued": 0, "running": 0, "succeeded": 677, "failed": 538,
              "canceled": 1785}  # fmt: skip
    batch = {**JOB, "id": "bat_14652166d5664d89b725b02bb6a0efa6", "status": "canceled",
             "lane": "standard", "counts": counts, "usage": {"cost_usd": 6.529778},
             "created_at": None, "finished_at": None}  # fmt: skip

    @contextlib.contextmanager
    def fake_gateway() -> Any:
        yield gateway_of([{"batches": [batch], "next_page_token": None}], [])

    monkeypatch.setattr(listing, "gateway", fake_gateway)
    shown = CliRunner().invoke(app, ["batches"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    header, row = (line.split() for line in shown.output.splitlines()[2:5:2])
    cells = dict(zip(header, row, strict=True))
    assert cells["done"] == "3000/3000" and cells["failed"] == "538"
    assert cells["canceled"] == "1785", shown.output
