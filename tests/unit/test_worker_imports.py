"""What a worker process imports as it starts.

``import anthropic`` costs about a second of CPU (the SDK builds some 1,500 pydantic models),
about half of a worker's start. A worker without ``SIFT_GENERATION_MODEL`` never calls the
model, so it must not pay for it: the SDK is imported where a client is built
(:mod:`worker.runtime.bootstrap`), never by a module the worker imports to start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# what `sift worker` imports before its runtime is built: the CLI (every command), the Celery
# app with every task registered, the runtime's builders
STARTING = """
import sys
import worker.cli
from worker.queue.celery_app import create_celery_app
import worker.runtime.bootstrap
create_celery_app()
print(",".join(sorted(m for m in ("anthropic", "worker.adapters.anthropic") if m in sys.modules)))
"""


def test_a_worker_imports_no_model_sdk_before_it_builds_a_model_client() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env["PYTHONPATH"] = str(ROOT)
    env["SIFT_REDIS_URL"] = "redis://127.0.0.1:1/0"  # named, never reached
    done = subprocess.run(
        [sys.executable, "-c", STARTING], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout
