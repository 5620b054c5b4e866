"""The long schemathesis run: every phase, many examples, against both e2e gateways.

    python benchmarks/bench_schemathesis.py [--max-examples 300] [--max-time SECONDS]

It starts the e2e stack (tests/e2e/conftest.py: redis-server, one Celery worker, the
``live`` gateway with a worker behind it and the ``idle`` gateway with the SSRF guard on
and a 64 KiB body limit), then runs ``schemathesis run`` on each gateway's
``/openapi.json`` with a valid key and the ``not_a_server_error`` check, phases
examples, coverage, fuzzing and stateful (on the idle gateway, without the index reads
and settings changes a worker answers: with no worker there, each is its 503
``backend_unavailable``). It prints schemathesis's summary and exits non-zero if any
operation answered a 5xx. The short form is
tests/security/test_schemathesis.py, in ``make test``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import KEYS, start_stack  # noqa: E402

# The operations a worker answers (an index read or settings change, sent on the search queue
# and waited on): the idle gateway has no worker, so each is its documented 503
# backend_unavailable after INDEX_READ_TIMEOUT_SECONDS, not a server error to report
WORKER_READS = r"^(list_indexes|get_index|update_index|list_documents|get_document)_"


def run(
    url: str,
    *,
    max_examples: int,
    max_time: int | None,
    seed: int,
    report: Path,
    exclude: str | None = None,
) -> int:
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run", url + "/openapi.json",
        "--header", f"Authorization: Bearer {KEYS[0]['key']}",
        "--checks", "not_a_server_error",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", str(max_examples),
        "--seed", str(seed),
        "--workers", "1",  # 2 trips a CPython 3.11 ast.parse race in hypothesis
        "--request-timeout", "40",
        "--suppress-health-check", "all",
        "--no-color",
        "--report", "junit", "--report-junit-path", str(report),
    ]  # fmt: skip
    if max_time:
        command += ["--max-time", str(max_time)]
    if exclude:
        command += ["--exclude-operation-id-regex", exclude]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, check=False).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--max-examples", type=int, default=300)
    parser.add_argument("--max-time", type=int, default=600, help="seconds per gateway")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sift-schemathesis-") as tmp:
        with start_stack(Path(tmp)) as stack:
            codes = {
                name: run(
                    url,
                    max_examples=args.max_examples,
                    max_time=args.max_time,
                    seed=args.seed,
                    report=Path(tmp) / f"{name}.xml",
                    exclude=WORKER_READS if name == "idle" else None,
                )
                for name, url in (("live", stack.live_url), ("idle", stack.idle_url))
            }
        for name, code in codes.items():
            print(f"{name}: {'no 5xx' if code == 0 else f'FAILED (exit {code})'}")
    sys.exit(0 if all(code == 0 for code in codes.values()) else 1)


if __name__ == "__main__":
    main()
