"""An option with a fixed set of values refuses another as ``--mode`` and ``--lane`` do: one
line naming the option, the values it takes and the one given, exit 2, before anything is
sent; never typer's enum message, which put pydantic's ``Value error, `` before it
(``Invalid value for '--window': Value error, '2h' is not one of '1h', '1d'.``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from worker.cli import app


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["cost", "--window", "2h"],
            "Invalid value for '--window': one of 1h, 1d is required, not '2h'",
        ),
        (
            ["index", "set", "demo", "--method", "max"],
            "Invalid value for '--method': one of rrf, linear is required, not 'max'",
        ),
        (
            ["search", "x", "--index", "demo", "--mode", "bm25"],
            "Invalid value for '--mode': one of fts, vector, hybrid is required, not 'bm25'",
        ),
    ],
    ids=["cost --window", "index set --method", "search --mode"],
)
def test_a_value_not_among_an_option_s_choices_is_named_with_them(
    args: list[str], expected: str
) -> None:
    # no gateway and no Prometheus answer here: the refusal comes before either is asked
    env = {"COLUMNS": "250", "SIFT_URL": "http://127.0.0.1:9", "SIFT_API_KEY": "k"}
    result = CliRunner().invoke(app, args, env=env)
    shown = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, shown
    assert expected in shown and "Value error" not in shown, shown


@pytest.mark.parametrize(
    ("args", "sent"),
    [
        (["cost", "--window", "1d"], "1d"),
        (["index", "set", "demo", "--method", "linear"], "linear"),
    ],
    ids=["cost --window", "index set --method"],
)
def test_each_choice_is_taken(args: list[str], sent: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value among the choices goes on to the command as its string."""
    import worker.cli.cost as cost
    import worker.cli.indexes as indexes

    seen: list[object] = []

    def stop(*values: object, **_: object) -> None:
        seen.extend(values)
        raise SystemExit(0)

    monkeypatch.setattr(cost, "fetch_report", stop)
    monkeypatch.setattr(indexes, "checked_patch", stop)
    result = CliRunner().invoke(
        app, args, env={"SIFT_URL": "http://127.0.0.1:9", "SIFT_API_KEY": "k"}
    )
    assert result.exit_code == 0, result.output
    assert sent in seen or {"fusion": {"method": sent}} in seen, seen
