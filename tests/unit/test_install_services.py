"""``scripts/install-services.sh`` refuses a redis-server older than 7.0 (``make demo`` and
``make test`` run it): it said nothing of one installed, and apt's on Debian 11 or Ubuntu
22.04 is 6.0.16, which ``sift up``, ``sift demo`` and every worker then refuse."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-services.sh"


@pytest.mark.parametrize(("version", "refused"), [("6.0.16", True), ("7.0.15", False)])
def test_an_installed_redis_older_than_7_is_refused(
    tmp_path: Path, version: str, refused: bool
) -> None:
    """A ``redis-server`` on ``PATH`` saying ``version``, a ``prometheus`` and a ``faketime``:
    nothing to install, so a Redis 7 passes (exit 0) and a Redis 6 is refused, saying where to
    get 7."""
    for name, says in [("redis-server", f"Redis server v={version} sha=00000000:0"),
                       ("prometheus", "prometheus, version 2.45.3"),
                       ("faketime", "faketime: Version 0.9.10")]:  # fmt: skip
        fake = tmp_path / name
        fake.write_text(f"#!/bin/sh\necho '{says}'\n")
        fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    ran = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=30, check=False)  # fmt: skip
    if not refused:
        assert ran.returncode == 0 and not ran.stderr, ran.stderr
        return
    assert ran.returncode == 1, ran.stderr
    assert f"is Redis {version}; Sift needs Redis 7.0 or later" in ran.stderr, ran.stderr
    assert "packages.redis.io" in ran.stderr, ran.stderr
