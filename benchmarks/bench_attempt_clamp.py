"""What bounding each rerank attempt by its deadline costs a call: the adapter's connections
clamped to the attempt (:class:`worker.adapters.attempt_deadline.DeadlineBackend`) against the same
adapter with httpx's plain network backend (its per-operation timeouts alone).

    python benchmarks/bench_attempt_clamp.py [--calls 2000] [--rounds 10]

Two ``AnthropicReranker`` instances call the fake Messages API (its own process, answering at
once) one call at a time, taking turns in rounds of ``--calls / --rounds`` calls, and print
this process's CPU per call and calls per second for each, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.services import free_port  # noqa: E402
from worker.adapters import anthropic as adapter  # noqa: E402
from worker.adapters.attempt_deadline import DeadlineBackend  # noqa: E402
from worker.core.policy import build_prompt  # noqa: E402


class Unclamped(adapter.AnthropicReranker):
    """The adapter with httpx's own network backend: no deadline for the whole attempt."""

    def _new_client(self, connections: int | None = None) -> Any:
        client = super()._new_client(connections)
        pool = client._client._transport._pool
        if isinstance(pool._network_backend, DeadlineBackend):
            pool._network_backend = pool._network_backend._inner
        return client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    port = free_port()
    fake = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_anthropic", "--port", str(port)], cwd=REPO
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(f"{url}/_fake/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        os.environ["ANTHROPIC_BASE_URL"] = url
        candidates = [(f"Title {i}", f"candidate text number {i}") for i in range(1, 31)]
        prompt = build_prompt("what causes tides?", candidates, k=10, max_chars=1200,
                              thinking_tokens=1024, tokens_per_position=8)  # fmt: skip
        rerankers = {
            "clamped (default)": adapter.AnthropicReranker("claude-haiku-4-5", api_key="k"),
            "httpx timeouts alone": Unclamped("claude-haiku-4-5", api_key="k"),
        }
        for reranker in rerankers.values():  # warm: a connection each, the JIT of pydantic
            for _ in range(50):
                reranker.rerank(prompt, 10.0)
        cpu = dict.fromkeys(rerankers, 0.0)
        wall = dict.fromkeys(rerankers, 0.0)
        per_round = max(1, args.calls // args.rounds)
        for _ in range(args.rounds):
            for name, reranker in rerankers.items():
                started, started_cpu = time.perf_counter(), time.process_time()
                for _ in range(per_round):
                    reranker.rerank(prompt, 10.0)
                cpu[name] += time.process_time() - started_cpu
                wall[name] += time.perf_counter() - started
        calls = per_round * args.rounds
        print(f"{calls} calls each, one at a time, load average {os.getloadavg()[0]:.2f}")
        for name in rerankers:
            print(f"  {name:22} {cpu[name] / calls * 1e6:7.0f} µs CPU per call   "
                  f"{calls / wall[name]:7.1f} calls/s")  # fmt: skip
        first, second = rerankers
        print(f"  CPU per call, {first} / {second}: {cpu[first] / cpu[second]:.3f}")
        for reranker in rerankers.values():
            reranker.close()
    finally:
        fake.terminate()
        fake.wait()


if __name__ == "__main__":
    main()
