"""A module of the project as it was at an earlier commit, to measure beside today's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def module_at(commit: str, path: str, name: str) -> ModuleType:
    """``path`` (e.g. ``worker/adapters/embedded.py``) as it was at ``commit``, loaded with
    ``git show`` as a module of its own called ``name``; its imports resolve to today's tree."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves a model's annotations through it
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module
