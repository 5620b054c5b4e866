"""``make install`` (which ``make demo`` and ``make test`` run first) makes the virtualenv
again when the one in ``.venv`` has no pip: what ``python3 -m venv`` leaves where Python's
``venv`` module is packaged apart and not installed (Debian and Ubuntu: python3-venv, not
on a fresh machine). It stops at ``ensurepip is not available`` after writing
``.venv/bin/python``, and ``make`` run again after ``apt-get install python3-venv`` took that
``.venv`` for made and stopped at ``.venv/bin/pip: No such file or directory``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_install_makes_a_venv_without_pip_again(tmp_path: Path) -> None:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)  # the failed venv's: a python, no pip
    made = tmp_path / "venv-made"
    # PY: `-m venv .venv` gives the venv a pip that takes anything
    fake_python = tmp_path / "python3"
    fake_python.write_text(
        "#!/bin/sh\n"
        '[ "$1 $2 $3" = "-m venv .venv" ] || exit 9\n'
        f"touch {made}\n"
        "printf '#!/bin/sh\\nexit 0\\n' > .venv/bin/pip && chmod +x .venv/bin/pip\n"
    )
    fake_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    ran = subprocess.run(["make", "install", f"PY={fake_python}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert made.exists(), "the venv without pip was taken as made"
    assert (tmp_path / ".venv" / ".installed").exists()
