"""``sift --help`` and each command's ``--help`` show a paragraph of a command's docstring as
one paragraph, wrapped at the terminal's width alone.

The docstrings are wrapped at the source's line length; typer's rich help keeps those line
breaks in the list of a group's commands and in every paragraph after a command's first,
and then wraps each piece again at the terminal's width, so a sentence broke after a word or
two (``sift index set``'s ``candidate`` / ``window.``). Read at a width every paragraph fits
in, each paragraph must be on one line.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from worker.cli import app

COMMAND: Any = typer.main.get_command(app)
#: wide enough for the longest paragraph on one line
WIDE = "2000"


def _commands() -> list[tuple[tuple[str, ...], Any]]:
    """Every command and group below ``sift``: its words and its click command."""
    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(command: Any, words: tuple[str, ...]) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            found.append(((*words, name), sub))
            walk(sub, (*words, name))

    walk(COMMAND, ())
    return found


def _paragraphs(command: Any) -> list[str]:
    """The docstring's paragraphs, each with its words joined by single spaces."""
    text = inspect.cleandoc(command.help or "")
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def _lines(*words: str) -> list[str]:
    """The lines of ``sift WORDS --help`` at a width nothing wraps at, spaces squeezed."""
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": WIDE})
    assert result.exit_code == 0, result.output
    lines = (" ".join(line.strip(" │").split()) for line in result.output.splitlines())
    return [line for line in lines if not line.startswith(("╭", "╰"))]  # a panel's edges


@pytest.mark.parametrize(
    ("words", "command"), [pytest.param(w, c, id=" ".join(w)) for w, c in _commands()]
)
def test_each_paragraph_of_a_command_s_help_is_one_line(
    words: tuple[str, ...], command: Any
) -> None:
    lines = _lines(*words)
    broken = [p for p in _paragraphs(command) if not any(p in line for line in lines)]
    assert broken == [], "\n".join(lines)


@pytest.mark.parametrize(
    "group",
    [
        pytest.param(w, id=" ".join(("sift", *w)))
        for w in [(), *(w for w, c in _commands() if getattr(c, "commands", None))]
    ],
)
def test_a_group_lists_each_command_s_first_paragraph_on_one_line(group: tuple[str, ...]) -> None:
    command = COMMAND
    for word in group:
        command = command.commands[word]
    lines = _lines(*group)
    broken = [
        name
        for name, sub in command.commands.items()
        if not any(line.startswith(f"{name} {_paragraphs(sub)[0]}") for line in lines)
    ]
    assert broken == [], "\n".join(lines)


@pytest.mark.parametrize(
    "words",
    [pytest.param(w, id=" ".join(("sift", *w))) for w in [(), *(w for w, _ in _commands())]],
)
def test_nothing_is_cut_short_at_80_columns(words: tuple[str, ...]) -> None:
    """Rich cuts a word longer than its column with an ellipsis; a default shown so
    (``sift worker --queues``: ``sift.search,sift.batch,sift.ingest…``) hid a queue."""
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.output, result.output
