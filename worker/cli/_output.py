"""How the CLI shows things: progress bars and a search result's hits, in one style."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text


def plain(value: Any, *, lines: bool = False) -> str:
    r"""``value`` as text to put in rich markup: a string from the gateway or a file (an id, a
    title, a query, a text, an error message) is shown as written, never read as markup, where
    ``[/x]`` raised MarkupError and ``[red]m-2`` showed as ``m-2``. The consoles are made with
    ``emoji=False`` too, so ``:fire:`` stays as written.

    Nor does it drive the terminal: every control character (C0, DEL, C1) and every bidi
    override or isolate is shown as its escape (:func:`visible`). A stored document's
    ``\x1b[2J`` cleared the screen, ``\x1b]8;;URL`` made a hyperlink whose text lies, and
    ``\u202e`` turned the rest of the line around. A tab stays; a newline stays only with
    ``lines`` (a document's text): in an id, a title, a table cell, a one-line message it is
    shown as ``\n``.

    >>> print(plain("[/x] at [a-z0-9]"))
    \[/x] at \[a-z0-9]
    >>> print(plain("ok\x1b[2J\rdone\u202e\n"))
    ok\x1b[2J\rdone\u202e\n
    >>> print(plain("one\ntwo", lines=True))
    one
    two
    """
    return escape(visible(str(value), lines=lines))


# what a terminal acts on rather than shows: the C0 controls (ESC starts CSI and OSC
# sequences, BEL ends an OSC, CR returns over the line), DEL and the C1 controls (0x9b is an
# 8-bit CSI), and the bidi overrides and isolates, which reorder what follows on the line
_CONTROLS = [*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPES = {c: repr(chr(c))[1:-1] for c in _CONTROLS}  # as Python writes it: \n, \x1b, \u202e
_ONE_LINE = str.maketrans({c: e for c, e in _ESCAPES.items() if c != ord("\t")})
_LINES = str.maketrans({c: e for c, e in _ESCAPES.items() if c not in (ord("\t"), ord("\n"))})


def visible(text: str, *, lines: bool = False) -> str:
    r"""``text`` with each control character and bidi override replaced by its escape as
    Python writes it (``\n``, ``\x1b``, ``\x9b``, ``\u202e``), the tab kept, and the newline
    kept only with ``lines``. :func:`plain` is this and the markup escape, for text put in
    markup.

    >>> visible("a\x1b]0;t\x07\tb\n") == r"a\x1b]0;t\x07" + "\tb" + r"\n"
    True
    >>> visible("a\nb\r", lines=True) == "a\nb" + r"\r"
    True
    """
    return text.translate(_LINES if lines else _ONE_LINE)


def cli_console(*, stderr: bool = False) -> Console:
    """A console for the CLI: no emoji codes, no guessed highlighting of numbers and URLs."""
    return Console(stderr=stderr, highlight=False, emoji=False)


def progress_bar() -> Progress:
    """The progress bar every long command shows, on stderr: stdout is the command's report
    (``sift batch ... > report.txt``, ``sift eval ... | tee``), and rich writes a bar's last
    frame to an output that is not a terminal, which put it among the report's lines."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=cli_console(stderr=True),
        transient=False,
    )


def local_time(value: Any) -> str:
    """An ISO time as the local clock reads it, to the second; the year left out (jobs are
    listed for 7 days, and a year is rarely what one looks for in a listing)."""
    if not value:
        return "–"
    return datetime.fromisoformat(str(value)).astimezone().strftime("%m-%d %H:%M:%S")


def left_out_note(console: Console, left_out: Sequence[str]) -> str:
    """The line under a fitted table naming the columns left out. Written to a pipe or a
    file, rich takes 80 columns whatever the terminal: the line says so, and how to change it.
    """
    names = ", ".join(left_out)
    # COLUMNS is rich's and the shell's, not a setting, on purpose (docs/settings.md)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return f"[dim]left out at this width: {names} (--json has all)[/]"
    return (
        f"[dim]left out at {console.width} columns, the width when the output is not a "
        f"terminal: {names} (COLUMNS=200 shows more, --json has all)[/]"
    )


WRAPPED_WIDTH = 12  # the least a free-text column (a query, a title) is given before it goes


def fitted_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int,
    drop_order: Sequence[str] = (),
    wrapped: Sequence[str] = (),
    right: Sequence[str] = (),
) -> tuple[Table, list[str]]:
    """A table of whole cells in ``width`` columns of terminal: rather than cut every cell
    to "st…", the columns in ``drop_order`` are left out, first named first, until the rest
    fit, each at its widest cell (a column in ``wrapped`` wraps down to
    :data:`WRAPPED_WIDTH`); an empty one of them goes first, a wrapped one not in
    ``drop_order`` last, and a cell that still cannot fit ends in "…". Returns the table and the
    columns with something in them that were left out (for a note: the JSON output has them
    all). Cells may hold rich markup.

    >>> _, out = fitted_table("t", ["id", "note", "when"], [["x" * 30, "a b", "2026-12-01"]],
    ...                       width=40, drop_order=["when", "note"])
    >>> out
    ['when']
    """
    at = {name: i for i, name in enumerate(columns)}
    cells = [[Text.from_markup(cell, emoji=False).cell_len for cell in row] for row in rows]

    def need(name: str) -> int:
        widest = max([len(name), *(row[at[name]] for row in cells)])
        return min(widest, WRAPPED_WIDTH) if name in wrapped else widest

    def empty(name: str) -> bool:
        return all(str(row[at[name]]) in ("", "–") for row in rows)

    shown, left_out = list(columns), []
    # a column with nothing in it goes first, and unnamed: nothing is lost. Then a wrapped
    # column, should the rest still not fit: squeezed under its least width rich folds it to
    # a few letters, then out of sight, and the columns beside it are cut
    last = [name for name in wrapped if name in columns and name not in drop_order]
    for name in [*sorted(drop_order, key=lambda name: not empty(name)), *last]:
        if sum(need(c) for c in shown) + 2 * len(shown) <= width:
            break
        shown.remove(name)
        if not empty(name):
            left_out.append(name)
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for name in shown:
        table.add_column(
            name,
            justify="right" if name in right else "left",
            no_wrap=name not in wrapped,
            # a cell cut all the same (a terminal narrower than an id) says so
            overflow="fold" if name in wrapped else "ellipsis",
        )
    for row in rows:
        table.add_row(*(row[at[name]] for name in shown))
    return table, left_out


def counted(count: float, one: str, many: str) -> str:
    """``count`` and the noun, singular for exactly one.

    >>> counted(1, "search", "searches"), counted(0, "batch", "batches"), counted(1500, "a", "b")
    ('1 search', '0 batches', '1,500 b')
    """
    return f"{count:,.0f} {one if count == 1 else many}"


def print_fitted(
    console: Console,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    **fit: Sequence[str],
) -> None:
    """:func:`fitted_table` at the console's width, printed, with the line naming what it
    left out (``fit``: its ``drop_order``, ``wrapped`` and ``right``)."""
    table, left_out = fitted_table(title, columns, rows, width=console.width, **fit)
    console.print(table)
    if left_out:
        console.print(left_out_note(console, left_out))


def _rank(value: Any) -> str:
    return "–" if value is None else str(value)


def print_result(console: Console, result: dict[str, Any], *, title: str | None = None) -> None:
    """One search result: the hits with their final, RRF and channel ranks, then the rerank
    and its usage."""
    hits = result.get("hits") or []
    table = Table(title=title or f"{len(hits)} hit(s)", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("id", no_wrap=True)
    table.add_column("title", overflow="ellipsis", max_width=40)
    for name in ("rrf", "bm25", "knn"):
        table.add_column(name, justify="right")
    for hit in hits:
        ranks = hit.get("ranks") or {}
        table.add_row(
            _rank(ranks.get("final")),
            plain(hit.get("id")),
            plain(hit.get("title") or ""),
            *(_rank(ranks.get(name)) for name in ("rrf", "bm25", "knn")),
        )
    console.print(table)
    rerank = result.get("rerank") or {}
    if rerank.get("applied"):
        console.print(f"rerank: applied ({plain(rerank.get('policy'))})")
    elif rerank.get("fallback_reason"):
        reason = plain(rerank["fallback_reason"])
        console.print(f"rerank: [yellow]not applied[/], fallback: {reason}")
    else:
        console.print("rerank: not applied")
    usage = result.get("usage") or {}
    if usage.get("requests"):
        console.print(usage_line(usage), soft_wrap=True)  # one line, for grep, at any width


def usage_line(usage: dict[str, Any]) -> str:
    """A ``usage`` object (a search's, a trace's, a batch's) in one line.

    >>> usage_line({"requests": 2, "input_tokens": 900, "output_tokens": 40, "cost_usd": 0.0011})
    'usage: 2 request(s), 900 input + 40 output tokens, cache read 0, cache write 0, $0.001100'
    """
    return (
        f"usage: {usage.get('requests', 0)} request(s), {usage.get('input_tokens', 0)} input + "
        f"{usage.get('output_tokens', 0)} output tokens, cache read "
        f"{usage.get('cache_read_input_tokens', 0)}, cache write "
        f"{usage.get('cache_creation_input_tokens', 0)}, {format_cost(usage.get('cost_usd'))}"
    )


def format_cost(cost: float | None) -> str:
    """A cost for a person: dollars, or ``unpriced`` when the model had no price (``null``).

    >>> format_cost(0.5), format_cost(None)
    ('$0.500000', 'unpriced (no price for the model: SIFT_PRICES)')
    """
    if cost is None:
        return "unpriced (no price for the model: SIFT_PRICES)"
    return f"${float(cost):.6f}"


def failure_kinds(
    failures: Mapping[str, int] | None,
    rerank_failures: Mapping[str, int] | None,
    errors: Counter[str] | None = None,
) -> str:
    """A batch's failed items by error type, most first, and its ``rerank_failed`` ones by
    class: its record's ``failures`` and ``rerank_failures``, or, from a gateway that has
    none (``failures`` None), ``errors`` (the types its results showed).

    >>> failure_kinds({"rerank_failed": 3, "deadline_exceeded": 1},
    ...     {"malformed": 1, "budget_exhausted": 2})
    'rerank_failed 3 (budget_exhausted 2, malformed 1), deadline_exceeded 1'
    >>> failure_kinds(None, None, Counter({"index_not_found": 2}))
    'index_not_found 2'
    """
    kinds = Counter(failures) if failures is not None else errors or Counter()
    classes = Counter(rerank_failures or {})
    parts = []
    for kind, n in kinds.most_common():
        part = f"{plain(kind)} {n}"
        if kind == "rerank_failed" and classes:
            part += " (" + ", ".join(f"{plain(c)} {m}" for c, m in classes.most_common()) + ")"
        parts.append(part)
    return ", ".join(parts)


def _seconds(value: Any) -> str:
    """A duration for a person: milliseconds under a second (retrieval takes a few).

    >>> _seconds(0.0042), _seconds(1.5), _seconds(None)
    ('4.2 ms', '1.50 s', '?')
    """
    if not isinstance(value, int | float):
        return "?"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _attempt_text(attempt: dict[str, Any]) -> str:
    """One model attempt for a person: its class, its own time (from send to answer) and
    the waits before it (the back-off, a 429's pause in it, and the rate budget's), where
    the time of a wait on the breaker was printed as the call's.

    >>> _attempt_text({"n": 2, "outcome": "ok", "seconds": 0.0054,
    ...                "backoff_wait_seconds": 0.21, "budget_wait_seconds": 0.59})
    '#2 ok 5.4 ms after 0.80 s waiting'
    >>> _attempt_text({"n": 1, "outcome": "rate_limited", "sent": False, "seconds": 0.0})
    '#1 rate_limited (not sent) 0.0 ms'

    A ``budget_exhausted`` attempt was sent nothing: its ``budget_wait_seconds`` is the whole
    wait the budget asked of it (any part it waited on the budget, and the rest, which would
    have run past the deadline), so it is not shown as waited; its back-off is.

    >>> _attempt_text({"n": 2, "outcome": "budget_exhausted", "seconds": 0.0,
    ...                "backoff_wait_seconds": 1.0, "budget_wait_seconds": 59.45})
    '#2 budget_exhausted (not sent: the budget would have held it 59.45 s in all, past the deadline) after 1.00 s waiting'
    """  # noqa: E501
    kinds = ["backoff_wait_seconds", "budget_wait_seconds"]
    asked = None
    if attempt.get("outcome") == "budget_exhausted":
        asked = attempt.get("budget_wait_seconds")
        kinds.remove("budget_wait_seconds")
    waits = [attempt.get(k) for k in kinds]
    waited = sum(w for w in waits if isinstance(w, int | float))
    if isinstance(asked, int | float):
        what = f" (not sent: the budget would have held it {asked:.2f} s in all, past the deadline)"
    else:
        what = f"{' (not sent)' if attempt.get('sent') is False else ''} "
        what += _seconds(attempt.get("seconds"))
    return f"#{attempt.get('n')} {attempt.get('outcome')}{what}" + (
        f" after {waited:.2f} s waiting" if round(waited, 2) > 0 else ""
    )


def trace_lines(trace: dict[str, Any]) -> list[str]:
    """A search's trace in a few plain lines: what retrieval found, each model attempt with
    its class and time, the positions the model returned, kept and dropped (and why), the
    fallback, the usage; and when the BM25 channel searched a long query's first words alone,
    that it did. The candidates' texts (the bulk of the raw trace) are left out: the
    raw trace is ``sift search --trace --json``.

    >>> for line in trace_lines({"mode": "fts", "policy": None, "coarse_limit": 3,
    ...         "channel_window": 6, "channel_counts": {"bm25": 4}, "candidates": [{"id": "a"}]}):
    ...     print(line)
    retrieval: mode fts, bm25 4, fused by rrf; 1 candidate(s) (coarse limit 3, channels 6 deep)
    rerank: not asked
    """
    counts = trace.get("channel_counts") or {}
    channels = ", ".join(f"{name} {n}" for name, n in counts.items()) or "no channel"
    method = (trace.get("fusion") or {}).get("method") or "rrf"  # a trace from before fusion
    fused = f"the backend's {method}" if trace.get("fused_by_backend") else method
    candidates = trace.get("candidates") or []
    lines = [
        f"retrieval: mode {trace.get('mode')}, {channels}, fused by {fused}; "
        f"{len(candidates)} candidate(s) (coarse limit {trace.get('coarse_limit')}, "
        f"channels {trace.get('channel_window')} deep)"
    ]
    if trace.get("bm25_query_truncated"):  # the rest of a long query was left out
        lines[0] += f"; bm25 searched the query's first {trace.get('bm25_words')} words"
    timings = trace.get("retrieval_seconds") or {}
    waits = {
        "queue wait": trace.get("queue_wait_seconds"),
        "slot wait": trace.get("slot_wait_seconds"),
    }
    stages = [f"{k} {_seconds(v)}" for k, v in waits.items() if v is not None] + [
        f"{k} {_seconds(v)}" for k, v in timings.items()
    ]
    if stages:
        lines.append("timings: " + ", ".join(stages))
    if not trace.get("policy"):
        lines.append("rerank: not asked")
        return lines
    truncated = sum(1 for c in candidates if c.get("truncated"))
    lines.append(
        f"rerank: {trace.get('policy')} with {trace.get('model')}"
        + (f"; {truncated} candidate text(s) truncated in the prompt" if truncated else "")
    )
    attempts = trace.get("attempts")
    if attempts is None:  # no model call was made (no candidates)
        lines.append("attempts: none")
        return lines
    shown = ", ".join(_attempt_text(a) for a in attempts)
    lines.append(f"attempts: {shown or 'none'}; rerank {_seconds(trace.get('rerank_seconds'))}")
    ids = {c.get("position"): c.get("id") for c in candidates}
    returned = trace.get("returned_positions")
    lines.append(f"returned: {returned if returned is not None else 'nothing'}")
    if "kept_positions" in trace:
        kept = ", ".join(f"{p} ({ids.get(p, '?')})" for p in trace["kept_positions"])
        dropped = ", ".join(
            f"{d.get('value')!r} ({d.get('reason')})" for d in trace.get("dropped_positions") or []
        )
        lines.append(f"kept: {kept or 'none'}")
        lines.append(f"dropped: {dropped or 'none'}")
    if trace.get("failure"):  # failed for good (fail_closed): no fallback was served
        lines.append(f"failed: {trace['failure']}")
    else:
        lines.append(f"fallback: {trace.get('fallback_reason') or 'none'}")
    lines.append(usage_line(trace.get("usage") or {}))
    return lines


def sample_path(name: str) -> Path:
    """A file of the bundled sample corpus (``worker/data``)."""
    return Path(str(resources.files("worker") / "data" / name))
