"""``make clean`` takes away what ``make install`` and the tools made (the venv, the caches),
never a user's data: ``.sift/data`` is ``sift up``'s default data folder (its index, Redis's AOF,
the development key), and a newcomer reinstalling with ``make clean`` lost it."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_clean_keeps_the_default_data_folder() -> None:
    dry = subprocess.run(
        ["make", "-n", "clean"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    removed = [
        Path(word).parts[0]
        for line in dry.splitlines()
        if line.startswith("rm ")
        for word in shlex.split(line)[1:]
        if not word.startswith("-")
    ]
    assert ".venv" in removed  # the recipe is the one that cleans
    assert ".sift" not in removed, dry
