"""How much of a batch a cancel saves: a 300-item reranked batch canceled 0.5 s after the
gateway accepted it, at default settings, over a few runs; canceled and succeeded counts.

    python benchmarks/bench_cancel.py [--runs 5] [--total 300] [--after 0.5]

Starts its own redis-server, one ``sift worker`` at its default concurrency, the gateway,
and the fake Messages API answering each rerank call after 0.3 to 1 s
(tests/reliability/canceling.py). An item is canceled if the cancel comes before it starts
or before its model call; one already waiting on the model finishes. "at the cancel" is
the batch as the cancel answered it (queued, running, canceled): the items it canceled
itself were still queued; the rest of the canceled ones were running and stopped at their
check before the model call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.reliability.canceling import cancel_stack, submit_and_cancel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--total", type=int, default=300, help="items per batch")
    parser.add_argument("--after", type=float, default=0.5, help="seconds to the cancel")
    args = parser.parse_args()
    canceled: list[int] = []
    with tempfile.TemporaryDirectory() as tmp, cancel_stack(Path(tmp)) as stack:
        print(f"{args.total}-item reranked batch, canceled {args.after:g} s after it was accepted")
        print(f"{'run':>4}{'at the cancel':>24}{'canceled':>10}{'succeeded':>11}{'failed':>8}"
              f"{'model calls':>13}{'status':>10}")  # fmt: skip
        for run_no in range(1, args.runs + 1):
            run = submit_and_cancel(stack, args.total, args.after, seed=run_no)
            at = run.cancel_body.get("counts", {})
            then = " ".join(f"{k[0]}{at.get(k, '?')}" for k in ("queued", "running", "canceled"))
            c = run.counts
            canceled.append(c["canceled"])
            print(f"{run_no:>4}{then:>24}{c['canceled']:>10}{c['succeeded']:>11}{c['failed']:>8}"
                  f"{run.model_calls:>13}{run.final['status']:>10}")  # fmt: skip
    print(f"\ncanceled: median {statistics.median(canceled):g} of {args.total} "
          f"(min {min(canceled)}, max {max(canceled)})")  # fmt: skip


if __name__ == "__main__":
    main()
