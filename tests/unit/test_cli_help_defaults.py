"""``sift <command> --help`` shows each option's default, as README.md says it does, also for
an option whose default is a setting's: the value, with the variable it is read from.

Those options default to ``None`` in the code (so the setting, from the environment, is
used), and typer showed no default (``sift up --port``) or the variable's name alone
(``sift worker --concurrency``: ``default: SIFT_WORKER_CONCURRENCY``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from worker.cli import app
from worker.settings import Settings

COMMAND: Any = typer.main.get_command(app)
SETTING = re.compile(r"SIFT_[A-Z0-9_]+")


def _default(variable: str) -> object:
    field = Settings.model_fields[variable.removeprefix("SIFT_").lower()]
    return field.get_default(call_default_factory=True)


def _help(*command: str) -> str:
    """The command's ``--help`` as a user reads it, wide enough that no line is cut, with a
    setting's own value in the environment that the help must not show."""
    env = {"COLUMNS": "250", "SIFT_GATEWAY_PORT": "18123", "SIFT_WORKER_CONCURRENCY": "77"}
    result = CliRunner().invoke(app, [*command, "--help"], env=env)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize(
    ("command", "option", "variable"),
    [
        ("up", "--port", "SIFT_GATEWAY_PORT"),
        ("up", "--metrics-port", "SIFT_WORKER_METRICS_PORT"),
        ("up", "--data-dir", "SIFT_DATA_DIR"),
        ("worker", "--concurrency", "SIFT_WORKER_CONCURRENCY"),
        ("worker", "--pool", "SIFT_WORKER_POOL"),
        ("worker", "--loglevel", "SIFT_LOG_LEVEL"),
        ("worker", "--processes", "SIFT_WORKER_PROCESSES"),
        ("gateway", "--port", "SIFT_GATEWAY_PORT"),
        ("cost", "--prometheus-url", "SIFT_PROMETHEUS_URL"),
    ],
)
def test_help_shows_the_setting_s_default_value_beside_its_name(
    command: str, option: str, variable: str
) -> None:
    shown = _help(command)
    line = shown[shown.index(option) :]
    expected = f"[default: {_default(variable)}, {variable}]"
    assert expected in line[: line.index("│")], line[:200]


def test_the_help_shows_the_code_s_defaults_not_the_environment_s() -> None:
    assert "18123" not in _help("gateway") and "[default: 8080, SIFT_GATEWAY_PORT]" in _help(
        "gateway"
    )
    assert "[default: 300, SIFT_WORKER_CONCURRENCY]" in _help("worker")


def _options() -> list[tuple[str, Any]]:
    """Every option of every command: its command's path and the click parameter."""
    found = []

    def walk(command: Any, path: str) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())
        found.extend((path, param) for param in getattr(command, "params", []))

    walk(COMMAND, "")
    return found


def test_every_option_read_from_a_setting_names_its_default() -> None:
    """An option whose help names a setting and whose own default is None (it reads the
    setting) says the setting's default, so none is added without one."""
    settings = {f"SIFT_{name.upper()}" for name in Settings.model_fields}
    missing = []
    for path, param in _options():
        help_text = getattr(param, "help", None) or ""
        named = [v for v in SETTING.findall(help_text) if v in settings]
        if named and param.default is None and "[default: " not in help_text:
            missing.append(f"sift {path} {param.opts[0]}")
    assert missing == []
