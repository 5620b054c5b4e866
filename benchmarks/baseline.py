"""A module of the project as it was at an earlier commit, to measure beside today's."""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def module_at(commit: str, path: str, name: str) -> ModuleType:
    """``path`` (e.g. ``worker/adapters/embedded.py``) as it was at ``commit``, loaded with
    ``git show`` as a module of its own called ``name``; its imports resolve to today's tree.

    At a commit where ``path`` had become a package (``worker/adapters/embedded/``), the
    whole package is loaded as ``name``: its modules import each other relatively, so they
    resolve to that commit's, and everything else to today's tree.
    """
    if _git("cat-file", "-e", f"{commit}:{path}").returncode != 0 and path.endswith(".py"):
        package = path.removesuffix(".py")
        if _git("cat-file", "-e", f"{commit}:{package}/__init__.py").returncode == 0:
            return _package_at(commit, package, name)
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


def _package_at(commit: str, package: str, name: str) -> ModuleType:
    """The package directory ``package`` at ``commit``, written out and imported as ``name``."""
    listed = _git("ls-tree", "--name-only", f"{commit}:{package}/")
    listed.check_returncode()
    root = tempfile.mkdtemp(prefix="sift-baseline-")
    atexit.register(shutil.rmtree, root, True)  # read at import only: gone at exit
    where = Path(root) / name
    where.mkdir()
    for file in listed.stdout.split():
        if file.endswith(".py"):
            shown = _git("show", f"{commit}:{package}/{file}")
            shown.check_returncode()
            (where / file).write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(
        name, where / "__init__.py", submodule_search_locations=[str(where)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
