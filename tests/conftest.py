"""Fixtures shared by the test folders (each folder's own are in its conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.full_disk import on_small_tmpfs


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> list[str]:
    """The command prefix that runs a program on a tmpfs of 1 MiB mounted at
    ``tmp_path / "mnt"`` (:func:`tests.full_disk.on_small_tmpfs`): the full-disk tests of the
    metrics folder, a unit's and a whole stack's."""
    (tmp_path / "mnt").mkdir()
    return on_small_tmpfs(tmp_path / "mnt")
