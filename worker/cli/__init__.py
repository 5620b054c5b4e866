"""The ``sift`` command line (typer and rich); each module adds one group of commands."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="sift",
    help="Sift: queue-based hybrid search with a listwise LLM rerank.",
    no_args_is_help=True,
    add_completion=False,
)

# Command modules register themselves on ``app`` when imported.
from worker.cli import client as _client  # noqa: E402,F401
from worker.cli import cost as _cost  # noqa: E402,F401
from worker.cli import evaluate as _evaluate  # noqa: E402,F401
from worker.cli import indexes as _indexes  # noqa: E402,F401
from worker.cli import listing as _listing  # noqa: E402,F401
from worker.cli import service as _service  # noqa: E402,F401
from worker.cli import status as _status  # noqa: E402,F401
