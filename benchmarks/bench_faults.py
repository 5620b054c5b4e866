"""The model-fault matrix through the real stack, N times over: outcomes, attempts, counters,
and the worst overrun of the search deadline measured (target: under 100 ms).

    python benchmarks/bench_faults.py [--repeat 5]

Starts its own redis-server, the fake Messages API, and one gateway+worker pair per failure
policy (tests/reliability/faults.py), with SIFT_SEARCH_DEADLINE_SECONDS=2 and
SIFT_GENERATION_TIMEOUT_SECONDS=1.5, so a fake that stalls 10 s runs into the deadline. A
search's duration is ``finished_at - started_at`` of its job record (the worker's clock, from
the task taking the job to the result being stored); the overrun is that minus the deadline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.reliability.faults import (  # noqa: E402
    CASES,
    DEADLINE,
    NO_VALID_RANKS,
    POLICIES,
    fault_stack,
    run_case,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each case and policy")
    args = parser.parse_args()
    cases = {**{n: c.behaviours for n, c in CASES.items()}, "no_valid_ranks": NO_VALID_RANKS}
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp, fault_stack(Path(tmp)) as stack:
        print(f"deadline {DEADLINE:g} s, {args.repeat} runs per cell\n")
        print(f"{'case':<18}{'policy':<13}{'outcome':<34}{'attempts':>9}"
              f"{'counter':>22}{'p50 ms':>9}{'max ms':>9}")  # fmt: skip
        for name, behaviours in cases.items():
            for policy in POLICIES:
                runs = [run_case(stack, policy, behaviours) for _ in range(args.repeat)]
                last = runs[-1]
                if last.status == "failed" and last.error:
                    outcome = f"failed {last.error['message'][:26]}"
                else:
                    reason = (last.rerank or {}).get("fallback_reason")
                    outcome = f"succeeded fallback={reason}"
                counters = ",".join(f"{k}={v:g}" for k, v in sorted(last.counters.items()))
                ms = [r.seconds * 1000 for r in runs]
                worst = max(worst, *(r.overrun_ms for r in runs))
                attempts = sorted({r.requests for r in runs})
                print(f"{name:<18}{policy:<13}{outcome:<34}{'/'.join(map(str, attempts)):>9}"
                      f"{counters:>22}{statistics.median(ms):>9.0f}{max(ms):>9.0f}")  # fmt: skip
    verdict = "under" if worst < 100 else "OVER"
    print(f"\nworst deadline overrun: {worst:.1f} ms ({verdict} the 100 ms target)")


if __name__ == "__main__":
    main()
