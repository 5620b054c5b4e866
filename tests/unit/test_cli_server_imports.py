"""What a ``sift`` command imports before it runs: not what another command alone needs.
``sift eval``'s ir-measures, numpy, the embedded backend and the in-process runtime were
imported by every command, ``sift gateway`` included, at each start."""

from __future__ import annotations

import json
import subprocess
import sys


def _imported_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(ran.stdout.splitlines()[-1]))


def test_the_command_line_does_not_import_what_sift_eval_alone_needs() -> None:
    """Every command is registered (``sift --help`` lists them), but ``sift eval``'s own
    imports come when it runs."""
    loaded = _imported_after("from worker.cli import app")
    assert {"worker.cli.evaluate", "worker.cli.service"} <= loaded
    evaluation = {"ir_measures", "numpy", "apsw", "worker.evaluation.harness"}
    assert not loaded & evaluation, sorted(loaded & evaluation)
