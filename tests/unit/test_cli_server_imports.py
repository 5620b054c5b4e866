"""What a ``sift`` command imports before it runs: not what another command alone needs.
``sift eval``'s ir-measures, numpy, the embedded backend and the in-process runtime were
imported by every command, ``sift gateway`` included, at each start; and ``sift gateway`` and
``sift worker`` imported every other command's module (the client commands' httpx, ...)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from worker.cli import COMMAND_MODULES, app_for


def _imported_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh interpreter holds after ``code`` (run in ``env``, else ours)."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True,
        env=env,
    )  # fmt: skip
    return set(json.loads(ran.stdout.splitlines()[-1]))


def test_the_command_line_does_not_import_what_sift_eval_alone_needs() -> None:
    """Every command is registered (``sift --help`` lists them), but ``sift eval``'s own
    imports come when it runs."""
    loaded = _imported_after("from worker.cli import app")
    assert {f"worker.cli.{module}" for module in COMMAND_MODULES} <= loaded
    evaluation = {
        "ir_measures",
        "numpy",
        "apsw",
        "worker.evaluation.harness",
        "worker.evaluation.scoring",
    }
    assert not loaded & evaluation, sorted(loaded & evaluation)
    names = {info.name for info in app_for(["search"]).registered_commands}
    assert {"gateway", "worker", "eval", "search", "status", "erase"} <= names


# what neither server command uses at its start (the worker imports the embedded backend,
# numpy and httpx itself, in its command, once its own checks pass)
OTHER_COMMANDS = {"worker.cli.evaluate", "worker.cli.client", "worker.cli.status", "ir_measures"}
NOT_SERVING = {"numpy", "apsw", "httpx", "worker.adapters.embedded"}  # the gateway's


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_a_server_command_imports_its_own_module_only(command: str) -> None:
    loaded = _imported_after(f"from worker.cli import app_for\napp_for([{command!r}, '--help'])")
    assert "worker.cli.service" in loaded
    unwanted = OTHER_COMMANDS | (NOT_SERVING if command == "gateway" else set())
    assert not loaded & unwanted, sorted(loaded & unwanted)


def test_a_gateway_its_checks_refuse_imports_no_server() -> None:
    """``sift gateway`` with no SIFT_REDIS_URL says so and exits 2 before it imports the app
    and uvicorn (half a second's CPU at each such start), which only a gateway that serves
    needs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    refused = (
        "from worker.cli import app_for\n"
        "try:\n"
        "    app_for(['gateway'])(['gateway', '--port', '1'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 2, exit.code"
    )
    loaded = _imported_after(refused, env)
    assert "worker.cli.service" in loaded
    assert not loaded & {"api_gateway.app", "uvicorn", "fastapi"}, sorted(
        loaded & {"api_gateway.app", "uvicorn", "fastapi"}
    )
