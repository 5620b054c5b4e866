"""The console script's Ctrl-C guard around the commands' import."""

from __future__ import annotations

import importlib.abc
import sys

import pytest

from worker import console


class _InterruptedImport(importlib.abc.MetaPathFinder):
    """Ctrl-C as ``worker.cli`` is imported (it takes about a second)."""

    def find_spec(self, name: str, *args: object) -> None:
        if name == "worker.cli":
            raise KeyboardInterrupt
        return None


def test_a_ctrl_c_while_the_commands_import_says_so_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "worker.cli" or m.startswith("worker.cli.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_InterruptedImport(), *sys.meta_path])
    with pytest.raises(SystemExit) as stopped:
        console.main()
    assert stopped.value.code == console.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted while starting; nothing was done\n"


def test_the_console_script_is_this_guard() -> None:
    from importlib.metadata import entry_points

    [script] = [e for e in entry_points(group="console_scripts") if e.name == "sift"]
    assert script.value == "worker.console:main"
