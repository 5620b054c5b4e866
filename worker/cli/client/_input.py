"""The input files: JSONL lines read and checked (a BEIR or a Sift document or query)
before anything is sent."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.console import Console

from worker.cli._common import EXIT_INTERRUPTED, InputError, _err
from worker.cli._output import plain
from worker.constants import (
    MAX_BATCH_QUERY_ID_CHARS,
    MAX_LIMIT,
    MAX_QUERY_CHARS,
)
from worker.contract import (
    BLANK,
    UNSEARCHABLE,
    DocumentRequest,
    from_beir,
    is_blank,
    is_searchable,
    unicode_only,
)
from worker.jsonl import field_problem, lines, parsed

MODES = ("fts", "vector", "hybrid")


@dataclass
class Loaded:
    """The valid records of a JSONL file, the line number of each, and the problems of the
    invalid ones."""

    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@contextmanager
def _nothing_sent_on_interrupt(read: Path, what: str) -> Iterator[None]:
    """Ctrl-C while ``read`` is still being read and checked, before any request: say so and
    exit 130 (typer exits 130 on Ctrl-C without a word, which read as a crash or a hang)."""
    try:
        yield
    except KeyboardInterrupt:
        _err().print(f"interrupted while reading {plain(read)}: {what}", soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _jsonl(path: Path) -> Generator[tuple[int, str], None, None]:
    """``(line number, line)`` per non-blank line; each is parsed by
    :func:`worker.jsonl.parsed`, where a line that is not UTF-8 or not JSON is a bad line like
    any other (``--skip-invalid`` skips it)."""
    return lines(path, InputError)


def document_from(obj: Any) -> dict[str, Any]:
    """A BEIR ``corpus.jsonl`` line (``_id``) or a Sift document as the gateway's document.

    Raises ValueError naming the field.
    """
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    beir = "_id" in obj
    if beir:
        obj = from_beir(obj)
    try:  # the gateway's own checks (metadata every backend can hold), so nothing is sent
        document = DocumentRequest.model_validate(obj)
    except ValidationError as exc:
        problem = field_problem(exc)
        if beir and problem.startswith("field 'id'"):  # named as the line spells it
            problem = "field '_id'" + problem.removeprefix("field 'id'")
        raise ValueError(problem) from None
    if is_blank(document.text):
        raise ValueError(f"field 'text': {BLANK}")
    return document.model_dump(exclude_none=True)


def query_from(obj: Any) -> dict[str, Any]:
    """A BEIR ``queries.jsonl`` line (``_id``, ``text``) or a Sift query as a batch item.

    Raises ValueError naming the field.
    """
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    # the line's own names for the query's id and text, in its errors
    id_field, text_field = "id", "query"
    if "_id" in obj:  # BEIR: _id, text (metadata ignored)
        obj, id_field, text_field = {"id": obj["_id"], "query": obj.get("text")}, "_id", "text"
    unknown = sorted(set(obj) - {"id", "query", "limit", "mode"})
    if unknown:
        raise ValueError(f"field {unknown[0]!r}: not a query field (id, query, limit, mode)")
    query_id, text = obj.get("id"), obj.get("query")
    if not isinstance(query_id, str) or not query_id:
        raise ValueError(f"field {id_field!r}: a non-empty string is required")
    if not isinstance(text, str) or not text:
        raise ValueError(f"field {text_field!r}: a non-empty string is required")
    for name, value in ((id_field, query_id), (text_field, text)):
        try:  # a lone surrogate (valid JSON) would stop the batch's send on a traceback
            unicode_only(value)
        except ValueError as exc:
            raise ValueError(f"field {name!r}: {exc}") from None
    if len(query_id) > MAX_BATCH_QUERY_ID_CHARS:
        raise ValueError(f"field {id_field!r}: longer than {MAX_BATCH_QUERY_ID_CHARS} characters")
    if is_blank(text):
        raise ValueError(f"field {text_field!r}: {BLANK}")
    if not is_searchable(text):
        raise ValueError(f"field {text_field!r}: {UNSEARCHABLE}")
    if len(text) > MAX_QUERY_CHARS:
        raise ValueError(f"field {text_field!r}: longer than {MAX_QUERY_CHARS} characters")
    item: dict[str, Any] = {"id": query_id, "query": text}
    if "limit" in obj:
        limit = obj["limit"]
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ValueError(f"field 'limit': an integer from 1 to {MAX_LIMIT} is required")
        item["limit"] = limit
    if "mode" in obj:
        if obj["mode"] not in MODES:
            raise ValueError(f"field 'mode': one of {', '.join(MODES)} is required")
        item["mode"] = obj["mode"]
    return item


def _load(
    path: Path,
    parse: Any,
    *,
    skip_invalid: bool,
    unique_ids: bool = False,
    first_line: int = 1,
    ids_only: bool = False,
) -> Loaded:
    """Read and check every line first, so a bad line stops the command before anything is
    sent. The lines before ``first_line`` (``sift ingest --from-line``) are counted, not
    read as records: an earlier run sent or skipped them. ``ids_only``: each record kept as
    its ``{"id": ...}`` alone (``sift ingest`` reads its documents again as it sends them)."""
    loaded = Loaded()
    seen: set[str] = set()
    for number, line in _jsonl(path):
        if number < first_line:
            continue
        try:
            record = parse(parsed(line))
            if unique_ids:
                if record["id"] in seen:
                    raise ValueError(f"field 'id': {record['id']!r} appears twice")
                seen.add(record["id"])
        except ValueError as exc:
            problem = f"{path}:{number}: {exc}"
            if not skip_invalid:
                raise InputError(
                    problem + " (nothing was sent; --skip-invalid skips such lines)"
                ) from None
            loaded.problems.append(problem)
            continue
        loaded.records.append({"id": record["id"]} if ids_only else record)
        loaded.lines.append(number)
    return loaded


def _report_skipped(console: Console, problems: list[str]) -> None:
    if not problems:
        return
    _err().print(f"[yellow]skipped {len(problems)} invalid line(s):[/]")
    for problem in problems[:10]:
        _err().print(f"  {plain(problem)}", soft_wrap=True)
    if len(problems) > 10:
        _err().print(f"  … and {len(problems) - 10} more")
