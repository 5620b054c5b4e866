"""A document's vector does not depend on the documents it is embedded with.

Ingest embeds a job's documents many at a time (model calls side by side on the cores;
fp32 pads each mini-batch to its longest text), while a query is embedded alone. Both
graphs are checked here on real MiniLM: every text embedded alone, in one call with all
the others, and in several different random groupings gets the same vector (max abs diff
below 1e-5), so the same documents rank the same; and a whole ingest through the runtime
stores the vectors the query path gives.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from worker.adapters.embedder import OnnxMiniLMEmbedder, default_model_path
from worker.adapters.int8_graph import int8_compute_model, with_fused_attention, without_nan_guards
from worker.contract import DocumentIn, SearchSpec
from worker.runtime.inprocess import build_runtime, embedding_text
from worker.settings import load_settings

DATA = Path(__file__).resolve().parents[2] / "worker" / "data"
TOLERANCE = 1e-5


def corpus() -> list[DocumentIn]:
    lines = (DATA / "sample_corpus.jsonl").read_text().splitlines()
    return [DocumentIn.model_validate(json.loads(line)) for line in lines if line]


def texts() -> list[str]:
    """The sample corpus, and texts from one word to past the 256-token cap, so every
    grouping pads most of its texts."""
    docs = [embedding_text(d.title, d.text) for d in corpus()]
    words = " ".join(docs).split()
    return [*docs, "tea", " ".join(words[:60]), " ".join(words[100:500])]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="module", params=["int8-matmul", "fp32"])
def embedder(request: pytest.FixtureRequest, cache_dir: Path) -> OnnxMiniLMEmbedder:
    """Each graph as a worker builds it: one onnxruntime thread a call, calls side by side."""
    int8 = request.param == "int8-matmul"
    return OnnxMiniLMEmbedder(threads=1, int8_cache_dir=cache_dir if int8 else None)


def groupings(n: int, seed: int) -> list[list[int]]:
    """The indexes 0..n-1 shuffled and cut into groups of random sizes."""
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    groups, start = [], 0
    while start < n:
        size = rng.choice([2, 3, 5, 8, 17])
        groups.append(order[start : start + size])
        start += size
    return groups


def embedded_in(
    embedder: OnnxMiniLMEmbedder, all_texts: list[str], groups: list[list[int]]
) -> npt.NDArray[np.float32]:
    out = np.zeros((len(all_texts), embedder.dimension), dtype=np.float32)
    for group in groups:
        out[group] = embedder.embed_array([all_texts[i] for i in group])
    return out


def test_a_texts_vector_is_the_same_alone_and_in_any_batch(
    embedder: OnnxMiniLMEmbedder, cache_dir: Path
) -> None:
    all_texts = texts()
    alone = np.stack([np.asarray(embedder.embed([t])[0], dtype=np.float32) for t in all_texts])
    together = embedder.embed_array(all_texts)
    assert float(np.abs(together - alone).max()) < TOLERANCE
    for seed in range(3):
        grouped = embedded_in(embedder, all_texts, groupings(len(all_texts), seed))
        assert float(np.abs(grouped - alone).max()) < TOLERANCE, f"grouping {seed}"
    sequential = OnnxMiniLMEmbedder(
        threads=1, int8_cache_dir=embedder._int8_cache_dir, parallel_calls=1
    )
    assert float(np.abs(sequential.embed_array(all_texts) - alone).max()) < TOLERANCE
    # the check can fail: the other graph's vectors are further apart than the tolerance
    other_graph = None if embedder._int8_cache_dir else cache_dir
    other = OnnxMiniLMEmbedder(threads=1, int8_cache_dir=other_graph)
    assert float(np.abs(other.embed_array(all_texts[:3]) - alone[:3]).max()) > TOLERANCE


def test_queries_rank_documents_the_same_whichever_batch_embedded_them(
    embedder: OnnxMiniLMEmbedder,
) -> None:
    all_texts = texts()
    queries = embedder.embed_array(["how hot should water be for green tea", "coffee roasting"])
    runs = [embedded_in(embedder, all_texts, [[i] for i in range(len(all_texts))])]
    runs += [embedded_in(embedder, all_texts, groupings(len(all_texts), s)) for s in (7, 8)]
    rankings = [np.argsort(-(vectors @ queries.T), axis=0, kind="stable") for vectors in runs]
    for ranking in rankings[1:]:
        assert np.array_equal(ranking, rankings[0])


def test_ingest_stores_the_vectors_the_query_path_gives(tmp_path: Path, cache_dir: Path) -> None:
    """Through the runtime at the default settings (the int8-compute graph): the same
    documents ingested in one job and split over three jobs of other neighbours score
    the same against a query, and as their text embedded alone would."""
    settings = load_settings(data_dir=tmp_path / "data", model_cache_dir=cache_dir)
    runtime = build_runtime(settings)
    docs = corpus()
    assert runtime.ingest("whole", "acme", docs) == len(docs)
    rng = random.Random(3)
    shuffled = rng.sample(docs, len(docs))
    for part in (shuffled[:4], shuffled[4:19], shuffled[19:]):
        runtime.ingest("split", "acme", part)
    query = "how hot should water be for green tea"
    hits = {}
    for index in ("whole", "split"):
        spec = SearchSpec(index=index, query=query, mode="vector", limit=len(docs))
        hits[index] = [(h.id, h.scores.knn) for h in runtime.search(spec, "acme").hits]
    assert [i for i, _ in hits["whole"]] == [i for i, _ in hits["split"]]
    np.testing.assert_allclose(
        [s for _, s in hits["whole"]], [s for _, s in hits["split"]], atol=TOLERANCE
    )
    embedder = runtime.pipeline.embedder
    q = np.asarray(embedder.embed([query])[0])
    by_id = {d.id: d for d in docs}
    top, score = hits["whole"][0]
    assert score is not None
    alone = np.asarray(embedder.embed([embedding_text(by_id[top].title, by_id[top].text)])[0])
    assert abs(float(q @ alone) - score) < TOLERANCE


def test_the_nan_guards_the_int8_graph_drops_change_no_vector(tmp_path: Path) -> None:
    """The guards after each attention softmax return their input for any text, padded or
    not: the shipped graph without them gives the same vectors, to the bit."""
    import onnx

    model = onnx.load(str(default_model_path()))
    assert without_nan_guards(model) == 6  # one per layer
    assert not [n for n in model.graph.node if n.op_type == "IsNaN"]
    unguarded = tmp_path / "unguarded.onnx"
    onnx.save(model, str(unguarded))
    all_texts = [*texts(), ""]
    guarded = OnnxMiniLMEmbedder(threads=1).embed_array(all_texts)  # padded mini-batches
    stripped = OnnxMiniLMEmbedder(threads=1, model_path=unguarded).embed_array(all_texts)
    assert np.array_equal(guarded, stripped)


def test_fused_attention_changes_no_vector_alone_or_padded(tmp_path: Path) -> None:
    """Each layer's attention as one MultiHeadAttention node (the mask as a key padding
    mask) gives the vectors of the attention the export spells out, to the bit: on the
    fp32 graph in padded mini-batches of 8, and on the int8-compute graph a worker makes."""
    import onnx

    model = onnx.load(str(default_model_path()))
    assert with_fused_attention(model) == 6  # one per layer
    assert not [n for n in model.graph.node if n.op_type == "Softmax"]
    fused = tmp_path / "fused.onnx"
    onnx.save(model, str(fused))
    all_texts = [*texts(), ""]
    spelled_out = OnnxMiniLMEmbedder(threads=1, batch_size=8).embed_array(all_texts)
    padded = OnnxMiniLMEmbedder(threads=1, batch_size=8, model_path=fused)
    assert np.array_equal(padded.embed_array(all_texts), spelled_out)
    int8 = {
        fuse: OnnxMiniLMEmbedder(
            threads=1,
            batch_size=1,
            model_path=int8_compute_model(default_model_path(), tmp_path, fuse_attention=fuse),
        ).embed_array(all_texts)
        for fuse in (True, False)
    }
    assert np.array_equal(int8[True], int8[False])
    # the check can fail: the int8 graph's vectors are not the fp32 graph's
    assert not np.array_equal(int8[True], spelled_out)
