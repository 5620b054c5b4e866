"""Can concurrent queries share one int8 model call? Side by side in one run: today's int8
graph one text per call, and two batch-independent int8 graphs (activations quantized per
row instead of per call) one per call and coalesced across N threads, on SciFact.

    python benchmarks/bench_query_batching.py --queries ../shared/data/scifact/queries.jsonl \\
        --corpus ../shared/data/scifact/corpus.jsonl [--threads 8,32,300] [--docs 48]

Why it was asked (issue 14): the worker embeds each query alone on the int8 graph, because
``quantize_dynamic``'s DynamicQuantizeLinear picks one scale for the whole activation tensor,
so in a batch a text's vector would depend on its neighbours. If a query's cost were mostly
per-call overhead, batching concurrent queries would cut it several-fold, provided each row
is quantized on its own. The graphs measured:

* ``int8``: Sift's graph (:func:`~worker.adapters.int8_graph.int8_compute_model`, r3).
  Its coalesced rows are a reference only (what batching could give at best): its vectors
  change with the batch.
* ``per-row``: the same folded fp32 graph, each weight MatMul's input quantized per row
  (token), symmetric: scale ``max|row| / 127``, the row divided by it, then uint8 with the
  zero point 128 (a scalar: onnxruntime's CPU ``MatMulInteger`` takes no per-row zero
  point, and int8 x int8 takes a path ten times slower here). Weights int8 per output
  channel, as ``quantize_dynamic`` makes them. ``com.microsoft.MatMulIntegerToFloat`` takes
  the row scales as a ``[batch, tokens, 1]`` A scale and broadcasts it over its output
  (onnxruntime 1.32; it would add a bias before that scale, so the bias Add stays apart).
* ``nbits8``: onnxruntime's own op for it, ``com.microsoft.MatMulNBits`` with 8-bit weights
  in blocks of 32 and ``accuracy_level=4`` (the activations quantized to int8 per row and
  block inside the kernel).

It prints, per graph: the largest difference between a text's vector alone and in batches
(all queries in one call, and random groupings), the smallest cosine to the fp32 graph over
the queries and ``--docs`` abstracts, the process CPU per query (all threads) and the rate,
one per call, then from each count of threads: a call each and coalesced through
:class:`~worker.adapters.embedder.CoalescingEmbedder` (the mean texts per model call beside
it), each model call holding one of the worker's CPU slots (``SIFT_CPU_SLOTS`` at its
default, one per core and one more) as ``build_embedder`` wraps it; and CPU per abstract one
per call against mini-batches of 8. Rounds are interleaved; the load average is printed with each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.adapters.embedder import (  # noqa: E402
    CoalescingEmbedder,
    OnnxMiniLMEmbedder,
    default_model_path,
)
from worker.adapters.int8_graph import (  # noqa: E402
    int8_compute_model,
    with_fused_attention,
    without_nan_guards,
)
from worker.evaluation.inputs import read_corpus  # noqa: E402
from worker.runtime.inprocess import embedding_text  # noqa: E402
from worker.runtime.slots import SlottedEmbedder, cpu_slots  # noqa: E402

Vectors = npt.NDArray[np.float32]


def folded_fp32(source: Path, work: Path) -> Any:
    """The shipped graph with its weights folded back to fp32, its NaN guards dropped and
    attention fused: what ``int8_compute_model`` hands to ``quantize_dynamic``."""
    import onnx
    import onnxruntime as ort

    folded = work / "folded.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(folded)
    options.log_severity_level = 3
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    model = onnx.load(str(folded))
    without_nan_guards(model)
    with_fused_attention(model)
    return model


def _weight_matmuls(model: Any) -> tuple[dict[str, Any], list[Any]]:
    inits = {i.name: i for i in model.graph.initializer}
    return inits, [
        n
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2
    ]


def _replace(model: Any, replaced: dict[int, list[Any]], extra: list[Any]) -> None:
    """Swap each node ``id`` in ``replaced`` for its new nodes; drop unused initializers."""
    import onnx

    graph = model.graph
    nodes = [new for n in graph.node for new in replaced.get(id(n), [n])]
    graph.initializer.extend(extra)
    used = {name for n in nodes for name in n.input}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))


def per_row_model(model: Any) -> Any:
    """``model`` (folded fp32) with every weight MatMul's input quantized per row: a row's
    int8 values and scale depend on that row alone, so no text's vector depends on its batch.
    MatMuls that share an input (query, key, value) share its quantization."""
    from onnx import helper, numpy_helper

    inits, matmuls = _weight_matmuls(model)
    consts = {
        "pr_inv127": np.array(1 / 127, np.float32),
        "pr_tiny": np.array(1e-12, np.float32),
        "pr_one": np.array(1.0, np.float32),
        "pr_zp": np.array(128, np.uint8),
    }
    extra = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    replaced: dict[int, list[Any]] = {}
    rows: dict[str, str] = {}  # an input -> the prefix of its quantized form
    for node in matmuls:
        a, weight = node.input[0], inits[node.input[1]]
        new: list[Any] = []
        if a not in rows:
            p = rows[a] = f"pr{len(rows)}"
            mk = helper.make_node
            new += [
                mk("Abs", [a], [p + "_abs"]),
                mk("ReduceMax", [p + "_abs"], [p + "_amax"], axes=[-1], keepdims=1),
                mk("Mul", [p + "_amax", "pr_inv127"], [p + "_s0"]),
                mk("Max", [p + "_s0", "pr_tiny"], [p + "_s"]),  # [batch, tokens, 1]
                mk("Div", [a, p + "_s"], [p + "_x"]),
                mk("QuantizeLinear", [p + "_x", "pr_one", "pr_zp"], [p + "_q"]),
            ]
        p = rows[a]
        w = numpy_helper.to_array(weight).astype(np.float32)
        w_scale = (np.maximum(np.abs(w).max(axis=0), 1e-12) / 127).astype(np.float32)
        w_q = np.clip(np.round(w / w_scale), -127, 127).astype(np.int8)
        b = weight.name
        extra += [
            numpy_helper.from_array(w_q, b + "_pr"),
            numpy_helper.from_array(w_scale, b + "_pr_scale"),
        ]
        new.append(
            helper.make_node(  # the row scales broadcast over the output (no bias input here:
                "MatMulIntegerToFloat",  # onnxruntime adds it before a non-scalar scale)
                [p + "_q", b + "_pr", p + "_s", b + "_pr_scale", "pr_zp"],
                list(node.output),
                domain="com.microsoft",
            )
        )
        replaced[id(node)] = new
    _replace(model, replaced, extra)
    return model


def nbits8_model(model: Any, block: int = 32) -> Any:
    """``model`` (folded fp32) with every weight MatMul as onnxruntime's ``MatMulNBits``:
    8-bit symmetric weights in blocks of ``block`` along K, int8 compute (``accuracy_level``
    4: the kernel quantizes each row of the input per block). The weights are packed by
    onnxruntime's own routine (``matmul_nbits_quantizer`` needs ``onnx_ir``, not installed)."""
    from onnx import helper, numpy_helper
    from onnxruntime.capi._pybind_state import quantize_matmul_8bits

    inits, matmuls = _weight_matmuls(model)
    replaced: dict[int, list[Any]] = {}
    extra: list[Any] = []
    for node in matmuls:
        weight = inits[node.input[1]]
        w = np.ascontiguousarray(numpy_helper.to_array(weight).astype(np.float32))
        k, n = w.shape
        blocks = -(-k // block)
        w = np.pad(w, ((0, blocks * block - k), (0, 0)))
        packed = np.zeros((n, blocks, block), np.uint8)
        scales = np.zeros((n, blocks), np.float32)
        zero_points = np.zeros((n, blocks), np.uint8)
        quantize_matmul_8bits(packed, w, scales, zero_points, block, n, k, True)
        names = [node.input[0], weight.name + "_q8", weight.name + "_q8_scale"]
        extra += [
            numpy_helper.from_array(packed, names[1]),
            numpy_helper.from_array(scales, names[2]),
        ]
        replaced[id(node)] = [
            helper.make_node(
                "MatMulNBits",
                names,
                list(node.output),
                domain="com.microsoft",
                K=k,
                N=n,
                bits=8,
                block_size=block,
                accuracy_level=4,
            )
        ]
    _replace(model, replaced, extra)
    return model


def cpu_ms(run: Callable[[], object], n: int) -> tuple[float, float]:
    """(process CPU ms per item, items per wall second) of ``run``."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return 1000 * (time.process_time() - cpu) / n, n / (time.perf_counter() - wall)


def threaded(embed: Callable[[list[str]], object], texts: list[str], n: int) -> tuple[float, float]:
    """``cpu_ms`` of ``texts`` embedded one per request from ``n`` threads at once."""
    with ThreadPoolExecutor(n) as pool:
        return cpu_ms(lambda: list(pool.map(lambda q: embed([q]), texts)), len(texts))


class Counting:
    """An embedder that counts model calls and texts, to print texts per call."""

    def __init__(self, inner: OnnxMiniLMEmbedder) -> None:
        self.inner, self.model_id, self.dimension = inner, inner.model_id, inner.dimension
        self.calls = self.texts = 0

    def embed(self, texts: list[str]) -> list[list[float]]:
        self.calls += 1
        self.texts += len(texts)
        return self.inner.embed(texts)


def independence(model: OnnxMiniLMEmbedder, texts: list[str], seed: int) -> float:
    """The largest |difference| between each text's vector alone and in batches: all in
    one call (mini-batches of the embedder's size), and random groups of 2-64."""
    alone = np.stack([model.embed_array([t])[0] for t in texts])
    worst = float(np.abs(model.embed_array(texts) - alone).max())
    rng, order, start = random.Random(seed), list(range(len(texts))), 0
    rng.shuffle(order)
    while start < len(order):
        group = order[start : start + rng.choice([2, 5, 17, 64])]
        got = model.embed_array([texts[i] for i in group])
        worst = max(worst, float(np.abs(got - alone[group]).max()))
        start += len(group)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--queries", type=Path, required=True, help="SciFact queries.jsonl")
    parser.add_argument("--corpus", type=Path, required=True, help="SciFact corpus.jsonl")
    parser.add_argument("--threads", default="8,32,300", help="coalesced thread counts")
    parser.add_argument("--docs", type=int, default=48, help="abstracts for the document rows")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--mini-batch", type=int, default=8, help="texts per model call when coalesced"
    )
    parser.add_argument("--graphs", default="int8,per-row", help="of int8,per-row,nbits8")
    args = parser.parse_args()
    qs = [json.loads(line)["text"] for line in args.queries.read_text().splitlines() if line]
    docs = [embedding_text(d.title, d.text) for d in read_corpus(args.corpus)[: args.docs]]
    threads = [int(t) for t in args.threads.split(",")]
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = {"int8": int8_compute_model(default_model_path(), work)}
        builders = {"per-row": per_row_model, "nbits8": nbits8_model}
        for name in args.graphs.split(","):
            if name in builders:
                paths[name] = work / f"{name}.onnx"
                onnx.save(builders[name](folded_fp32(default_model_path(), work)), paths[name])

        def model(name: str, batch: int = 32, calls: int | None = None) -> OnnxMiniLMEmbedder:
            # one onnxruntime thread a call, as a worker runs it (SIFT_EMBEDDING_THREADS=1)
            return OnnxMiniLMEmbedder(
                threads=1, model_path=paths[name], batch_size=batch, parallel_calls=calls
            )

        fp32 = OnnxMiniLMEmbedder(threads=1)
        reference = fp32.embed_array(qs), fp32.embed_array(docs)
        for name in paths:
            single = model(name, batch=1, calls=1)
            cosine = min(
                float((single.embed_array(texts) * ref).sum(1).min())
                for texts, ref in zip((qs, docs), reference, strict=True)
            )
            diff = independence(model(name, calls=1), qs, seed=1)
            print(f"{name:8s} max |alone - batched| {diff:.2e}  min cosine to fp32 {cosine:.4f}")
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}, load average {os.getloadavg()[0]:.1f}")
            for name in paths:
                one = model(name, batch=1, calls=1)
                one.embed_array(qs[:8])
                ms, rate = cpu_ms(lambda one=one: [one.embed_array([q]) for q in qs], len(qs))
                row = [f"alone {ms:.2f} ms ({rate:.0f}/s)"]
                for n in threads:
                    texts = qs * max(1, (3 * n) // len(qs) + 1)
                    # a call each, holding one of the worker's CPU slots: the worker today
                    slotted = SlottedEmbedder(one, cpu_slots(0))
                    ms, rate = threaded(slotted.embed, texts, n)
                    row.append(f"{n} threads alone {ms:.2f} ms ({rate:.0f}/s)")
                    counting = Counting(model(name, batch=args.mini_batch))
                    # as build_embedder does for fp32: one call at a time, holding a slot
                    coalescing = CoalescingEmbedder(SlottedEmbedder(counting, cpu_slots(0)))
                    threaded(coalescing.embed, texts[:n], n)  # warm up
                    counting.calls = counting.texts = 0
                    ms, rate = threaded(coalescing.embed, texts, n)
                    per_call = counting.texts / max(1, counting.calls)
                    row.append(f"coalesced {ms:.2f} ms ({rate:.0f}/s, {per_call:.1f}/call)")
                for batch in (1, 8):
                    doc_model = model(name, batch=batch, calls=1)
                    doc_model.embed_array(docs[:2])
                    ms, rate = cpu_ms(lambda m=doc_model: m.embed_array(docs), len(docs))
                    row.append(f"docs {batch}/call {ms:.1f} ms ({rate:.0f}/s)")
                print(f"  {name:8s} CPU per query: " + "\n    ".join(row), flush=True)


if __name__ == "__main__":
    main()
