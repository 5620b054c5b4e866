"""The ``sift`` command line (typer and rich); each module adds one group of commands.

The app is :data:`worker.cli._app.app`; importing a command module registers its commands on
it. ``from worker.cli import app`` imports them all, in :data:`COMMAND_MODULES`' order
(``sift --help`` lists them so); :func:`app_for` imports only the one a server command needs.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer

#: Every command module, in the order ``sift --help`` lists their commands
COMMAND_MODULES = (
    "client",
    "cost",
    "erase",
    "evaluate",
    "indexes",
    "listing",
    "service",
    "data_upgrades",
    "up",
    "status",
    "tenants",
)
#: The commands that run a server, and the one module each needs: a start of ``sift gateway``
#: (each replica, each restart) or ``sift worker`` (each of its processes) imported every
#: other command's module too: ``sift gateway`` took 0.79 CPU-s to its first answer, 0.69 without
SERVER_COMMANDS = {"gateway": "service", "worker": "service"}

__all__ = ["COMMAND_MODULES", "app", "app_for"]


def app_for(args: Sequence[str]) -> typer.Typer:
    """The app to run the command line ``args`` (``sys.argv[1:]``) with: only the server
    command's own module when ``args`` starts with one (:data:`SERVER_COMMANDS`), else every
    module. A server command's own help, options and errors are the same either way."""
    modules: tuple[str, ...] = COMMAND_MODULES
    if args and (only := SERVER_COMMANDS.get(args[0])):
        modules = (only,)
    for module in modules:
        importlib.import_module(f"{__name__}.{module}")
    from worker.cli._app import app

    _unwrap_help(app)
    return app


def _unwrap_help(app: typer.Typer) -> None:
    """Give each command of ``app`` and its groups its docstring with every paragraph on one
    line. The docstrings are wrapped at the source's width, and typer's rich help keeps those
    line breaks in a group's list of commands and in the paragraphs after a command's first,
    then wraps each piece again at the terminal's: a sentence broke after a word or two."""
    for command in app.registered_commands:
        text = command.help or inspect.getdoc(command.callback) or ""
        command.help = "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))
    for group in app.registered_groups:
        if group.typer_instance is not None:
            _unwrap_help(group.typer_instance)


def __getattr__(name: str) -> typer.Typer:
    """``app``, with every command registered (:func:`app_for` of no arguments)."""
    if name == "app":
        return app_for(())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
