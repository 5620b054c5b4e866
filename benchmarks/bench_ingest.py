"""Ingest through the API against the raw embedder: SciFact's 5,183 abstracts, one run.

    python benchmarks/bench_ingest.py --corpus ../shared/data/scifact/corpus.jsonl [--repeat 2]

* raw: the same MiniLM called straight through ``tokenizers`` and ``onnxruntime`` (no
  Sift code): every candidate way to run it (the int8-compute graph Sift uses and the
  shipped fp32-product graph; onnxruntime's fusions all on, or SkipLayerNormalization's
  off as Sift has it; 1 or 16 texts a call; calls side by side, one onnxruntime thread
  each, or one call at a time on every core's threads) is tried on a sample, three
  interleaved rounds, and the one of the best median embeds the whole corpus. Batched
  int8 calls give a text a vector that depends on its neighbours, so Sift cannot use
  them; they are candidates anyway, so the baseline is the fastest way this machine has
  to run the model at all.
  When the int8 graph wins, the same candidate also embeds the corpus on the graph Sift
  made before its attention was fused (r2), for the old-against-new figure.
* api: ``sift ingest`` (the CLI, 500 documents a request) through the gateway, Redis and
  one worker process at the default settings, into the embedded backend; timed from the
  command's start to its exit, then the documents are counted in the index. The worker
  is warmed by a small ingest first, as a running service would be.

Each repeat measures both sides again, alternately; it prints docs/s both ways, the
ratio, the total ingest time and the CPU seconds per 1,000 documents (raw: this process;
api: the worker, the gateway, Redis and the CLI together), and their ratio too: on a
shared machine the two sides' wall clocks see different loads, CPU per document does not.
Targets: ratio >= 0.8, the corpus in <= 60 s. The load average is printed with each repeat.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_queue import AUTH, KEY, base_env, cpu_seconds  # noqa: E402
from worker.adapters.embedded import EmbeddedBackend  # noqa: E402
from worker.adapters.embedder import (  # noqa: E402
    MAX_TOKENS,
    default_model_path,
    default_tokenizer_path,
)
from worker.adapters.int8_graph import int8_compute_model  # noqa: E402
from worker.evaluation.inputs import read_corpus  # noqa: E402
from worker.processes.machine import cpu_count as cores  # noqa: E402
from worker.processes.stack import (  # noqa: E402
    child_env,
    gateway_process,
    redis_server,
    sift_command,
    worker_process,
)
from worker.runtime.inprocess import embedding_text  # noqa: E402

TENANT = "bench"
SAMPLE = 128  # texts per candidate trial
ROUNDS = 3  # trials per candidate
PROCESSES = ("worker", "gateway", "redis", "cli")


@dataclass(frozen=True)
class Candidate:
    graph: str  # "int8" or "fp32"
    fused: bool  # onnxruntime's SkipLayerNormalization fusion on (its default)
    side_by_side: bool  # calls on every core at once, one thread each; else one call, all cores
    batch: int  # texts per model call

    @property
    def name(self) -> str:
        how = "side by side" if self.side_by_side else "one at a time"
        fusion = "all fusions" if self.fused else "SkipLayerNorm unfused"
        return f"{self.graph}, {fusion}, {self.batch} a call, {how}"


class RawEmbedder:
    """MiniLM straight from tokenizers and onnxruntime: sort by length, pad per call,
    mean-pool over the mask, normalise."""

    def __init__(self, model: Path, fused: bool, side_by_side: bool) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(default_tokenizer_path()))
        self.tokenizer.enable_truncation(max_length=MAX_TOKENS)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        options.intra_op_num_threads = 1 if side_by_side else cores()
        self.session = ort.InferenceSession(
            str(model),
            options,
            providers=["CPUExecutionProvider"],
            disabled_optimizers=[] if fused else ["SkipLayerNormFusion"],
        )
        self.types = "token_type_ids" in {i.name for i in self.session.get_inputs()}
        self.workers = cores() if side_by_side else 1

    def embed(self, texts: list[str], batch: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        encodings = self.tokenizer.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(encodings[i].ids))
        out = np.zeros((len(texts), 384), dtype=np.float32)

        def run(rows: list[int]) -> None:
            width = max(len(encodings[i].ids) for i in rows)
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros_like(ids)
            for r, i in enumerate(rows):
                ids[r, : len(encodings[i].ids)] = encodings[i].ids
                mask[r, : len(encodings[i].ids)] = 1
            feeds = {"input_ids": ids, "attention_mask": mask}
            if self.types:
                feeds["token_type_ids"] = np.zeros_like(ids)
            hidden = self.session.run(None, feeds)[0]
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
            out[rows] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

        calls = [order[i : i + batch] for i in range(0, len(order), batch)]
        with ThreadPoolExecutor(self.workers) as pool:
            list(pool.map(run, calls))
        return out


def timed(work: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``work``."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def fastest(texts: list[str], graphs: dict[str, Path]) -> tuple[Candidate, RawEmbedder]:
    """Every candidate on a sample, in interleaved rounds (so a burst of load elsewhere hits
    them alike); the one of the best median docs/s."""
    sample = texts[:: max(1, len(texts) // SAMPLE)][:SAMPLE]
    embedders: dict[Candidate, RawEmbedder] = {}
    for graph, fused, side_by_side in itertools.product(graphs, (False, True), (True, False)):
        embedder = RawEmbedder(graphs[graph], fused, side_by_side)
        embedder.embed(sample[:8], 8)  # warm up
        for batch in (1, 16):
            embedders[Candidate(graph, fused, side_by_side, batch)] = embedder
    trials: dict[Candidate, list[float]] = {c: [] for c in embedders}
    for _ in range(ROUNDS):
        for candidate, embedder in embedders.items():
            wall, _ = timed(lambda e=embedder, b=candidate.batch: e.embed(sample, b))
            trials[candidate].append(len(sample) / wall)
    for candidate, rates in trials.items():
        print(f"  trial {candidate.name}: {statistics.median(rates):.1f} docs/s", flush=True)
    best = max(trials, key=lambda c: statistics.median(trials[c]))
    return best, embedders[best]


def raw_side(
    texts: list[str], best: Candidate, embedder: RawEmbedder, before: RawEmbedder | None
) -> dict[str, Any]:
    """The fastest candidate on the whole corpus; with ``before``, the same candidate on the
    graph Sift made before attention was fused (r2) too, for the old-against-new figure."""
    wall, cpu = timed(lambda: embedder.embed(texts, best.batch))
    run = {
        "raw_best": best.name,
        "raw_docs_per_s": len(texts) / wall,
        "raw_seconds": wall,
        "raw_cpu_s_per_1000": 1000 * cpu / len(texts),
    }
    if before is not None:
        wall, cpu = timed(lambda: before.embed(texts, best.batch))
        run["raw_seconds_r2_graph"] = wall
        run["raw_cpu_s_per_1000_r2_graph"] = 1000 * cpu / len(texts)
    return run


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pid_listening(port: int) -> int:
    """The process whose command line names ``--port PORT`` (the gateway we started)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                args = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"gateway" in args and str(port).encode() in args:
                return int(proc.name)
    raise RuntimeError(f"no gateway on port {port}")


@contextmanager
def stack(tmp: Path) -> Iterator[tuple[str, dict[str, str], list[int]]]:
    """Redis, one worker at the default settings, the gateway: (URL, CLI env, pids)."""
    import redis

    with redis_server(tmp / "redis") as redis_url:
        env = child_env(base_env(tmp, redis_url, 0), inherit_sift=False)
        redis_pid = int(redis.Redis.from_url(redis_url).info()["process_id"])
        with (
            worker_process(tmp / "worker", env) as worker,
            gateway_process(tmp / "gateway", env) as url,
        ):
            gateway_pid = pid_listening(int(url.rsplit(":", 1)[1]))
            cli_env = {**env, "SIFT_URL": url, "SIFT_API_KEY": KEY}
            yield url, cli_env, [worker.pid, gateway_pid, redis_pid]


def sift_ingest(corpus: Path, index: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        sift_command("ingest", str(corpus), "--index", index),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"sift ingest failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def api_side(
    corpus: Path, n: int, index: str, env: dict[str, str], pids: list[int], data: Path
) -> dict[str, Any]:
    """``sift ingest`` of the corpus; CPU per 1,000 documents in all, and per process."""
    before = [cpu_seconds(pid) for pid in pids] + [children_cpu()]
    wall, _ = timed(lambda: sift_ingest(corpus, index, env))
    after = [cpu_seconds(pid) for pid in pids] + [children_cpu()]
    spent = [1000 * (b - a) / n for a, b in zip(before, after, strict=True)]
    counted = EmbeddedBackend(data).count(index, TENANT)
    if counted != n:
        raise RuntimeError(f"{index}: {counted} documents in the index, {n} in the corpus")
    return {
        "api_docs_per_s": n / wall,
        "api_seconds": wall,
        "api_cpu_s_per_1000": sum(spent),
        **{f"api_cpu_s_per_1000_{name}": v for name, v in zip(PROCESSES, spent, strict=True)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--corpus", type=Path, required=True, help="SciFact's corpus.jsonl")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    documents = read_corpus(args.corpus)
    texts = [embedding_text(d.title, d.text) for d in documents]
    cache = Path.home() / ".cache" / "sift"  # where a worker keeps the int8 graph
    graphs = {"int8": int8_compute_model(default_model_path(), cache), "fp32": default_model_path()}
    print(f"trying the raw candidates: load average {os.getloadavg()[0]:.2f}", flush=True)
    best, embedder = fastest(texts, graphs)
    before = None
    if best.graph == "int8":  # the same way to run it, on the graph with attention spelled out
        unfused = int8_compute_model(default_model_path(), cache, fuse_attention=False)
        before = RawEmbedder(unfused, best.fused, best.side_by_side)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with stack(tmp) as (url, env, pids):
            import httpx

            warm = {"documents": [{"id": "w", "text": "warm up"}]}
            warmed = httpx.post(
                f"{url}/v1/indexes/warm/documents", params={"wait": 30}, json=warm, headers=AUTH
            )
            warmed.raise_for_status()
            job = warmed.json()  # past ?wait it is still running: polled until final
            while job["status"] not in ("succeeded", "failed", "canceled"):
                time.sleep(1)
                job = httpx.get(url + warmed.headers["location"], headers=AUTH).json()
            # a worker not warmed would be measured with its start-up in the first repeat
            assert job["status"] == "succeeded", job
            for i in range(args.repeat):
                load = os.getloadavg()[0]
                print(f"repeat {i + 1}: load average {load:.2f}", flush=True)
                run = {"load_average_1m": load}
                run.update(raw_side(texts, best, embedder, before))
                run.update(
                    api_side(args.corpus, len(texts), f"scifact{i}", env, pids, tmp / "data0")
                )
                run["ratio"] = run["api_docs_per_s"] / run["raw_docs_per_s"]
                # on a shared machine the two sides' wall clocks see different loads; CPU
                # per document does not
                run["cpu_ratio_raw_over_api"] = (
                    run["raw_cpu_s_per_1000"] / run["api_cpu_s_per_1000"]
                )
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in run.items()}, indent=2), flush=True)  # fmt: skip
                runs.append(run)
    print(
        f"ratio api/raw: median {statistics.median(r['ratio'] for r in runs):.3f} by docs/s, "
        f"{statistics.median(r['cpu_ratio_raw_over_api'] for r in runs):.3f} by CPU "
        f"over {len(runs)} repeat(s); SciFact ingested in "
        + ", ".join(f"{r['api_seconds']:.1f} s" for r in runs)
    )


if __name__ == "__main__":
    main()
