"""The ``sift`` typer app, on which each command module registers its commands.

It lives apart from :mod:`worker.cli` so a command module imports it without importing the
package that imports that module (no cycle); :mod:`worker.cli` imports the modules in the
order ``sift --help`` lists their commands.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="sift",
    help="Sift: queue-based hybrid search with a listwise LLM rerank.",
    no_args_is_help=True,
    add_completion=False,
)
