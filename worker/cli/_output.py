"""How the CLI shows things: progress bars and a search result's hits, in one style."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def progress_bar(console: Console) -> Progress:
    """The progress bar every long command shows."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


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
            str(hit.get("id")),
            str(hit.get("title") or ""),
            *(_rank(ranks.get(name)) for name in ("rrf", "bm25", "knn")),
        )
    console.print(table)
    rerank = result.get("rerank") or {}
    if rerank.get("applied"):
        console.print(f"rerank: applied ({rerank.get('policy')})")
    elif rerank.get("fallback_reason"):
        console.print(f"rerank: [yellow]not applied[/], fallback: {rerank['fallback_reason']}")
    else:
        console.print("rerank: not applied")
    usage = result.get("usage") or {}
    if usage.get("requests"):
        console.print(
            f"usage: {usage.get('requests', 0)} request(s), "
            f"{usage.get('input_tokens', 0)} input + {usage.get('output_tokens', 0)} output "
            f"tokens, cache read {usage.get('cache_read_input_tokens', 0)}, "
            f"cache write {usage.get('cache_creation_input_tokens', 0)}, "
            f"{format_cost(usage.get('cost_usd'))}"
        )


def format_cost(cost: float | None) -> str:
    """A cost for a person: dollars, or ``unpriced`` when the model had no price (``null``).

    >>> format_cost(0.5), format_cost(None)
    ('$0.500000', 'unpriced (no price for the model: SIFT_PRICES)')
    """
    if cost is None:
        return "unpriced (no price for the model: SIFT_PRICES)"
    return f"${float(cost):.6f}"


def sample_path(name: str) -> Path:
    """A file of the bundled sample corpus (``worker/data``)."""
    return Path(str(resources.files("worker") / "data" / name))
