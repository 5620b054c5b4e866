"""The int8-compute embedding graph, made once from the shipped MiniLM graph and cached.

The shipped graph stores int8 weights but multiplies in fp32. :func:`int8_compute_model`
makes, once per source graph and :data:`GRAPH_REVISION`, a graph whose matrix products run in
int8 (onnxruntime's dynamic quantization, per channel, MatMul only), with each layer's
attention fused into one node (:func:`with_fused_attention`) and the NaN guards that would
stop the fusion taken out (:func:`without_nan_guards`). It is made in a folder beside the
cache under a file lock, fsynced, and renamed into place, so a crash or a second process
never leaves a half-written graph to load.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DIMENSION = 384
HEADS = 12
HEAD_SIZE = DIMENSION // HEADS
# Bumped when the vectors or the graph int8_compute_model makes change, so neither a cached
# graph nor an evaluation's cached index of the old vectors is reused.
GRAPH_REVISION = "r3"
# the folder a graph is made in, beside it: "<graph>.making-<random>"
WORK_SUFFIX = ".making-"


def int8_compute_model(source: Path, cache_dir: Path, fuse_attention: bool = True) -> Path:
    """``source`` with its MatMuls quantized for int8 compute, made once per source file and
    onnxruntime version and kept in ``cache_dir``: one process makes it (under a lock file
    beside it; the others wait for it, then load it; on a filesystem that refuses locks, each
    makes it) in a folder beside it, then renames it, so no process reads half a file (a
    maker killed half-way leaves the folder: the next one clears it). Its no-op NaN guards go
    first (:func:`without_nan_guards`), then each layer's attention becomes one fused node
    (:func:`with_fused_attention`; ``fuse_attention=False`` keeps it spelled out, as the
    r2 graph had it, for the benchmarks): the same vectors, bit for bit, less CPU."""
    import onnxruntime as ort

    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    revision = GRAPH_REVISION if fuse_attention else f"{GRAPH_REVISION}-unfused"
    target = cache_dir / f"minilm-int8-matmul-{revision}-{digest}-ort{ort.__version__}.onnx"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        # a worker's processes all warm up at start: one makes the graph, the others wait
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            locked = True
        except OSError as exc:  # a filesystem without locks (NFS with no lock manager)
            logger.warning("cannot lock %s (%s): making the graph without the lock",
                           lock.name, exc.strerror or exc)  # fmt: skip
            locked = False
        if not target.is_file():
            if locked:  # what a maker killed half-way left (no other maker runs now)
                for work in cache_dir.glob(target.name + WORK_SUFFIX + "*"):
                    shutil.rmtree(work, ignore_errors=True)
            logger.info("making the int8-compute embedding graph in %s (once, a few seconds)",
                        cache_dir)  # fmt: skip
            _make_int8_graph(source, target, fuse_attention)
            logger.info("made the int8-compute embedding graph %s", target)
    return target


def _make_int8_graph(source: Path, target: Path, fuse_attention: bool) -> None:
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # removed here, not at the interpreter's exit (TemporaryDirectory's finalizer): a
    # process that exits while a thread of it makes the graph leaves the folder to the next
    # maker, rather than racing that thread for it (a traceback, and the folder left anyway)
    work = tempfile.mkdtemp(dir=target.parent, prefix=target.name + WORK_SUFFIX)
    try:
        folded = Path(work) / "folded.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(folded)  # the weights folded back to fp32
        options.log_severity_level = 3
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(str(folded))
        without_nan_guards(graph)
        if fuse_attention:
            with_fused_attention(graph)
        onnx.save(graph, str(folded))
        made = Path(work) / "int8.onnx"
        with _quantizer_quiet():
            quantize_dynamic(
                folded,
                made,
                per_channel=True,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"],
            )
        _durably_replace(made, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _durably_replace(made: Path, target: Path) -> None:
    """Rename ``made`` to ``target`` so that a crash or a power cut never leaves ``target``
    empty or half-written: its bytes reach the disk first, then the rename, then the folder's
    entry (a graph file that is there is taken as whole, and never made again)."""
    with open(made, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(made, target)
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


@contextlib.contextmanager
def _quantizer_quiet() -> Iterator[None]:
    """Drop what onnxruntime's quantizer logs on the root logger meanwhile: a WARNING advising
    its pre-processing script (advice for any model; this graph is judged by its vectors, see
    the module's docstring) and an INFO for each tensor it leaves in fp32: 25 lines in a
    worker's log, or the WARNING on a command's stderr, the first time a machine embeds."""
    import onnxruntime.quantization

    package = os.path.dirname(onnxruntime.quantization.__file__) + os.sep

    def not_the_quantizers(record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(package)

    root = logging.getLogger()
    root.addFilter(not_the_quantizers)
    try:
        yield
    finally:
        root.removeFilter(not_the_quantizers)


def without_nan_guards(model: Any) -> int:
    """Drop each ``Where(IsNaN(p), 0, p)`` after an attention softmax from ``model`` (an
    ``onnx.ModelProto``, changed in place); answers how many.

    The exporter guards against a row whose every key is masked, which gives NaN. Only
    padding is masked, and every text has at least its [CLS] and [SEP] tokens, so no row
    is all masked and the guard returns ``p`` unchanged: 12% of a 256-token call's kernel
    time spent on nothing (onnxruntime's profiler).
    """
    nodes = list(model.graph.node)
    guards = {n.output[0]: n for n in nodes if n.op_type == "IsNaN"}
    replaced: dict[str, str] = {}  # a guarded Where's output -> the softmax it guards
    dropped: set[str] = set()  # the outputs of the nodes to drop (proto wrappers have no identity)
    for node in nodes:
        guard = guards.get(node.input[0]) if node.op_type == "Where" else None
        if guard is not None and node.input[2] == guard.input[0]:
            replaced[node.output[0]] = guard.input[0]
            dropped.update((node.output[0], guard.output[0]))
    kept = [n for n in nodes if n.output[0] not in dropped]
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = replaced.get(name, name)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return len(replaced)


def with_fused_attention(model: Any) -> int:
    """Replace each layer's attention in ``model`` (an ``onnx.ModelProto``, changed in
    place) by one ``com.microsoft.MultiHeadAttention`` node; answers how many layers.

    The shipped graph spells attention out as the exporter decomposed it: a dozen shape
    and mask nodes, two fp32 MatMuls, the additive mask and a Softmax per layer. After
    dynamic quantization onnxruntime no longer recognises that pattern, so it runs node by
    node: its MatMuls, Softmax, Transposes and Slices alone took 33% of a 256-token call
    (onnxruntime's profiler). The fused node takes the query, key and value projections
    (their bias Adds, found by the initializer names of the BERT export) and the attention
    mask as a key padding mask, at the scale the graph's own constants give
    (:func:`_scale_of`). Its vectors equal the unfused graph's, to the bit, alone or in a
    padded batch (``tests/integration/test_embedder_batches.py``); the int8 graph runs
    4-7% less CPU on SciFact's abstracts (``benchmarks/bench_doc_embedding.py``). A graph
    of another shape (no bias Adds by those names) is left as it is: 0.
    """
    from onnx import TensorProto, helper

    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    bias_add = {n.input[1]: n for n in graph.node if n.op_type == "Add" and len(n.input) == 2}
    layers = sorted(
        name.removesuffix(".attention.self.query.bias")
        for name in bias_add
        if name.endswith(".attention.self.query.bias")
    )
    if not layers:
        return 0
    fused = [
        helper.make_node(
            "Cast", ["attention_mask"], ["sift_key_padding_mask"], to=TensorProto.INT32
        )
    ]
    for layer in layers:
        q, k, v = (
            bias_add[f"{layer}.attention.self.{part}.bias"].output[0]
            for part in ("query", "key", "value")
        )
        dense = bias_add[f"{layer}.attention.output.dense.bias"]
        context = producer[dense.input[0]].input[0]  # what the output projection multiplies
        graph.node.remove(producer[context])
        fused.append(
            helper.make_node(
                "MultiHeadAttention",
                [q, k, v, "", "sift_key_padding_mask"],
                [context],
                domain="com.microsoft",
                num_heads=HEADS,
                scale=_scale_of(graph, q),
                name=f"sift_attention_{layer.rsplit('.', 1)[-1]}",
            )
        )
    graph.node.extend(fused)
    _sort_and_prune(graph)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(layers)


def _scale_of(graph: Any, query: str) -> float:
    """The attention scale as the exporter wrote it: the query (and the key) multiplied by
    a constant ``c`` after the head split, so the scores are scaled by ``c * c``. Taking
    the graph's own constant keeps the vectors equal to the unfused graph's to the bit
    (``HEAD_SIZE ** -0.5`` differs from it in the last float32 place, and an int8 graph
    magnifies that: 0.01 apart at worst). A graph without that Mul gets ``HEAD_SIZE ** -0.5``."""
    from onnx import numpy_helper

    constants = {i.name: i for i in graph.initializer}
    name = query
    for _ in range(4):  # Reshape, Transpose, then the Mul
        node = next((n for n in graph.node if name in n.input), None)
        if node is None:
            break
        if node.op_type == "Mul" and node.input[1] in constants:
            c = float(numpy_helper.to_array(constants[node.input[1]]))
            return c * c
        name = node.output[0]
    return float(HEAD_SIZE**-0.5)


def _sort_and_prune(graph: Any) -> None:
    """Put ``graph``'s nodes in topological order, then drop those that no output needs
    (the decomposed attention the fused nodes replaced)."""
    ready = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        waiting = []
        for node in pending:
            if all(name in ready for name in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                waiting.append(node)
        if len(waiting) == len(pending):
            raise ValueError("the embedding graph has a cycle or a missing input")
        pending = waiting
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(ordered):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
