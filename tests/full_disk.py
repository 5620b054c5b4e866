"""A small filesystem a test can fill: a tmpfs mounted in a mount namespace of its own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def on_small_tmpfs(mount: Path, size: str = "1m") -> list[str]:
    """The command prefix that runs a program, and every process it starts, with a tmpfs of
    ``size`` mounted at ``mount`` (an existing folder) in a mount namespace of their own: no
    other process sees it, and it goes with them, so there is nothing to unmount. ``unshare``
    as root, or with a user namespace of one's own; the test is skipped where neither can."""
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = f'mount -t tmpfs -o size={size} tmpfs "{mount}" && exec "$@"'
    prefix = [*namespace, "sh", "-c", script, "sh"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    return prefix


def fill(folder: Path) -> None:
    """Write ``folder/ballast`` until the filesystem has no room left."""
    with open(folder / "ballast", "wb", buffering=0) as ballast:
        try:
            while True:
                ballast.write(b"x" * 4096)
        except OSError:
            pass
