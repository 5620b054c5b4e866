"""What several commands share: their exit codes, the two consoles, and an expected failure
(:class:`InputError`, a gateway's error) as one red line and exit 1."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from worker.cli._http import GatewayError
from worker.cli._output import cli_console, plain

EXIT_ERROR = 1
EXIT_ITEMS_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


class InputError(Exception):
    """A bad line in an input file; the message names the file, the line and the field."""


def _out() -> Console:
    return cli_console()


def _err() -> Console:
    return cli_console(stderr=True)


@contextmanager
def _expected_errors() -> Iterator[None]:
    """Turn expected failures into one red line on stderr and exit code 1."""
    try:
        yield
    except (GatewayError, InputError) as exc:
        _err().print(f"[bold red]error:[/] {plain(exc)}", soft_wrap=True)
        raise typer.Exit(EXIT_ERROR) from None
