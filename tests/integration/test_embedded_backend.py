"""The embedded backend and the local embedder, for real: SQLite on disk, the ONNX model."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import threading
import time
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import apsw
import numpy as np
import pytest

from worker.adapters import embedded
from worker.adapters.embedded import EmbeddedBackend, derive_revision, match_expression
from worker.adapters.embedder import OnnxMiniLMEmbedder
from worker.contract import Channel, FilterValue
from worker.core.types import ChannelQuery, ChannelResults, Document, HardFilters, IndexProbe
from worker.errors import ConfigError, EmbeddingModelMismatch, IndexNotFound, InvalidRequest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
BOTH: tuple[Channel, ...] = ("bm25", "knn")

CORPUS = {
    "vitd": ("Vitamin D", "Vitamin D deficiency raises the risk of bone fractures in the elderly."),
    "stat": ("Statins", "Statins lower LDL cholesterol and reduce cardiovascular events."),
    "mal": ("Malaria", "Artemisinin combination therapy treats uncomplicated malaria."),
    "sleep": ("Sleep", "Short sleep duration is associated with obesity in children."),
    "smoke": ("Smoking", "Tobacco smoking is the leading cause of lung cancer."),
}


@pytest.fixture(scope="module")
def embedder() -> OnnxMiniLMEmbedder:
    return OnnxMiniLMEmbedder()


def docs_of(items: dict[str, tuple[str, str]], **metadata: FilterValue) -> list[Document]:
    return [
        Document(id=i, title=t, text=x, revision="", metadata=dict(metadata))
        for i, (t, x) in items.items()
    ]


def load(
    backend: EmbeddedBackend,
    embedder: OnnxMiniLMEmbedder,
    tenant: str,
    documents: Sequence[Document],
    index: str = "sci",
) -> None:
    vectors = embedder.embed_array([f"{d.title}. {d.text}" for d in documents])
    assert backend.upsert(index, tenant, documents, vectors) == len(documents)


def search(
    backend: EmbeddedBackend,
    embedder: OnnxMiniLMEmbedder,
    tenant: str,
    text: str,
    size: int = 10,
    channels: tuple[Channel, ...] = BOTH,
    index: str = "sci",
    **fields: FilterValue,
) -> ChannelResults:
    vector = embedder.embed_array([text])[0] if "knn" in channels else None
    query = ChannelQuery(
        index=index,
        filters=HardFilters(tenant, fields),
        channels=channels,
        size=size,
        text=text,
        vector=vector,
    )
    return backend.retrieve(query)


def ids(results: ChannelResults, channel: Channel) -> list[str]:
    return [hit.document.id for hit in results.hits[channel]]


# --- the embedder ------------------------------------------------------------------


def test_embedder_gives_unit_vectors_that_agree_in_batch_and_alone(
    embedder: OnnxMiniLMEmbedder,
) -> None:
    texts = [f"{t}. {x}" for t, x in CORPUS.values()] + ["word " * 400]
    batch = embedder.embed_array(texts)
    assert batch.shape == (len(texts), 384) and batch.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    alone = np.stack([embedder.embed_array([t])[0] for t in texts])
    assert (batch * alone).sum(axis=1).min() > 0.999
    as_lists = embedder.embed(texts[:2])
    assert len(as_lists) == 2 and len(as_lists[0]) == embedder.dimension == 384
    assert embedder.embed_array([]).shape == (0, 384)


def test_embedder_scores_close_sentences_higher(embedder: OnnxMiniLMEmbedder) -> None:
    a, b, c = embedder.embed_array(
        [
            "A cat is sleeping on the sofa.",
            "A kitten naps on the couch.",
            "Interest rates rose sharply in the bond market.",
        ]
    )
    assert float(a @ b) > float(a @ c) + 0.3


# --- the backend -------------------------------------------------------------------


def test_match_expression_quotes_terms_and_drops_stopwords() -> None:
    assert match_expression('What is "the" role of p53 OR NEAR(x)?') == (
        '"role" OR "p53" OR "near" OR "x"'
    )
    assert match_expression("?! ...") is None  # no word at all: an empty BM25 channel


def test_a_query_of_stopwords_alone_searches_all_its_terms() -> None:
    """Dropping the stopwords left "The Who" and "to be or not to be" no term, and their
    BM25 channel silently empty: such a query searches every term it has instead."""
    assert match_expression("what is the") == '"what" OR "is" OR "the"'
    assert match_expression("The Who") == '"the" OR "who"'
    assert match_expression("to be or not to be") == '"to" OR "be" OR "or" OR "not"'


def test_a_query_of_stopwords_alone_finds_its_words_by_bm25(
    tmp_path: Path, embedder: OnnxMiniLMEmbedder
) -> None:
    backend = EmbeddedBackend(tmp_path)
    stopwords = {
        "band": ("The Who", "The Who are an English rock band formed in London in 1964."),
        "hamlet": ("Hamlet", "To be, or not to be, that is the question."),
        "chess": ("Chess", "Deep Blue beat Kasparov at chess."),
    }
    load(backend, embedder, "acme", docs_of(stopwords))
    bm25: tuple[Channel, ...] = ("bm25",)
    assert ids(search(backend, embedder, "acme", "The Who", channels=bm25), "bm25")[0] == "band"
    hamlet = search(backend, embedder, "acme", "to be or not to be", channels=bm25)
    assert ids(hamlet, "bm25")[0] == "hamlet"
    # a query with a word past the stopwords still drops them: "the" finds no other document
    assert ids(search(backend, embedder, "acme", "the chess", channels=bm25), "bm25") == ["chess"]
    backend.close()


def test_bm25_does_not_split_cjk_runs_nor_fold_full_width_forms(
    tmp_path: Path, embedder: OnnxMiniLMEmbedder
) -> None:
    """The limits docs/embedded-backend.md states ("What BM25 matches"), pinned so the docs
    change with the tokenizer: FTS5's unicode61 keeps a run of CJK characters as one word, so
    a word inside a Japanese or Chinese sentence is not found, only a run that stands alone;
    and it does no NFKC folding, so full-width ``１２３４５`` is not ``12345``."""
    backend = EmbeddedBackend(tmp_path)
    texts = {
        "ja": ("東京タワー", "東京タワーは日本の首都東京にある電波塔です。"),
        "zh": ("", "北京是中华人民共和国的首都和政治中心。"),
        "router": ("", "Model number 12345 is the fastest router."),
    }
    load(backend, embedder, "acme", docs_of(texts))

    def bm25(text: str) -> list[str]:
        return ids(search(backend, embedder, "acme", text, channels=("bm25",)), "bm25")

    assert bm25("電波塔") == [] and bm25("首都") == [] and bm25("政治") == []
    assert bm25("東京タワー") == ["ja"]  # the title: a run of its own
    assert bm25("北京是中华人民共和国的首都和政治中心") == ["zh"]  # the whole run
    assert bm25("１２３４５") == [] and bm25("12345") == ["router"]
    backend.close()


def test_bm25_finds_a_word_typed_decomposed_or_with_a_dotted_capital_i(
    tmp_path: Path, embedder: OnnxMiniLMEmbedder
) -> None:
    """A query typed in NFD (an accent as a combining mark, as macOS gives it) was cut at
    the mark by ``\\w+``: "résumé" searched "sume", "Zürich" searched "zu" OR "rich" (a
    decoy's word), "piñata" "pin" OR "ata"; and "İstanbul", whose lower case is "i" plus a
    combining dot, searched "stanbul". FTS5 keeps such words whole in the documents (and
    folds the accent), so the query keeps a word's marks too. A word FTS5 does cut at a
    mark (Devanagari's vowel signs) is searched as the phrase of its pieces, not as any one
    of them."""
    backend = EmbeddedBackend(tmp_path)
    nfc, nfd = (functools.partial(unicodedata.normalize, form) for form in ("NFC", "NFD"))
    texts = {
        "cv-nfc": ("", nfc("Résumé writing for a café owner")),
        "cv-nfd": ("", nfd("Résumé writing for a café owner")),
        "zurich": ("", nfc("A weekend in Zürich by train")),
        "pinata": ("", nfc("A piñata for the birthday party")),
        "istanbul": ("İstanbul", "A travel guide"),
        "hindi": ("", "हिन्दी भाषा"),
        "decoy": ("", "How the rich get richer: a pin for the map, ata, सुदनह, द न ह"),
    }
    load(backend, embedder, "acme", docs_of(texts))

    def bm25(text: str) -> list[str]:
        return sorted(ids(search(backend, embedder, "acme", text, channels=("bm25",)), "bm25"))

    for form in (nfc, nfd):
        assert bm25(form("résumé")) == ["cv-nfc", "cv-nfd"]
        assert bm25(form("RÉSUMÉ")) == ["cv-nfc", "cv-nfd"]
        assert bm25(form("Zürich")) == ["zurich"]
        assert bm25(form("piñata")) == ["pinata"]
    assert bm25("İstanbul") == bm25("istanbul") == bm25("ISTANBUL") == ["istanbul"]
    assert bm25("हिन्दी") == ["hindi"]
    assert match_expression(nfd("Zürich résumé")) == '"zürich" OR "résumé"'
    assert match_expression("\u0301 ?") is None  # a mark alone is no word
    backend.close()


def test_index_survives_a_restart(tmp_path: Path, embedder: OnnxMiniLMEmbedder) -> None:
    backend = EmbeddedBackend(tmp_path)
    load(backend, embedder, "acme", docs_of(CORPUS))
    before = search(backend, embedder, "acme", "vitamin D and fractures")
    backend.close()

    reopened = EmbeddedBackend(tmp_path)
    after = search(reopened, embedder, "acme", "vitamin D and fractures")
    assert ids(after, "bm25")[0] == ids(after, "knn")[0] == "vitd"
    for channel in BOTH:
        assert ids(after, channel) == ids(before, channel)
        assert [h.score for h in after.hits[channel]] == pytest.approx(
            [h.score for h in before.hits[channel]]
        )
    assert reopened.channels("sci", "acme") == frozenset(BOTH)
    assert reopened.count("sci", "acme") == len(CORPUS)


def test_tenants_are_isolated_before_the_window(
    tmp_path: Path, embedder: OnnxMiniLMEmbedder
) -> None:
    backend = EmbeddedBackend(tmp_path)
    weak = {f"a{i}": ("Bones", f"Hip fractures in cohort {i} were rare.") for i in range(4)}
    load(backend, embedder, "acme", docs_of(CORPUS | weak))
    rivals = {
        f"r{i}": ("Vitamin D fractures", f"Vitamin D deficiency and bone fractures, study {i}.")
        for i in range(60)
    }
    rivals["vitd"] = CORPUS["vitd"]  # the same id, another tenant: a different document
    load(backend, embedder, "rival", docs_of(rivals))

    results = search(backend, embedder, "acme", "vitamin D deficiency fractures", size=3)
    for channel in BOTH:
        assert ids(results, channel)[0] == "vitd"
        assert all(not i.startswith("r") for i in ids(results, channel))
        assert len(results.hits[channel]) == 3  # acme's own documents fill the window
    with pytest.raises(IndexNotFound):  # a tenant with no document there: no index of its own
        search(backend, embedder, "nobody", "vitamin D")
    assert backend.count("sci", "rival") == 61


def test_metadata_filters_apply_inside_both_channels(
    tmp_path: Path, embedder: OnnxMiniLMEmbedder
) -> None:
    backend = EmbeddedBackend(tmp_path)
    load(backend, embedder, "acme", docs_of(CORPUS, year=2020, open=True))
    late = {f"n{i}": ("Vitamin D", f"Vitamin D and bone fractures, trial {i}.") for i in range(20)}
    load(backend, embedder, "acme", docs_of(late, year=2024, open=True))

    results = search(backend, embedder, "acme", "vitamin D fractures", size=4, year=2020)
    for channel in BOTH:
        assert ids(results, channel)[0] == "vitd"
        assert all(h.document.metadata["year"] == 2020 for h in results.hits[channel])
    assert len(results.hits["knn"]) == 4
    only_late = search(backend, embedder, "acme", "vitamin D", size=50, year=2024, open=True)
    assert sorted(ids(only_late, "knn")) == sorted(ids(only_late, "bm25")) == sorted(late)
    assert search(backend, embedder, "acme", "vitamin D", year="2024").hits["knn"] == []


def test_upsert_by_id_replaces_text_and_vector_together(
    tmp_path: Path, embedder: OnnxMiniLMEmbedder
) -> None:
    backend = EmbeddedBackend(tmp_path)
    load(backend, embedder, "acme", docs_of(CORPUS))
    first = search(backend, embedder, "acme", "malaria treatment artemisinin", size=5)
    revision = first.hits["bm25"][0].document.revision
    assert ids(first, "bm25")[0] == ids(first, "knn")[0] == "mal"

    load(backend, embedder, "acme", docs_of({"mal": CORPUS["mal"]}))  # identical: same revision
    again = search(backend, embedder, "acme", "malaria", channels=("bm25",))
    assert again.hits["bm25"][0].document.revision == revision

    new = Document(id="mal", title="Submarines", text="Sonar guides submarine navigation.")
    load(backend, embedder, "acme", [new])
    assert backend.count("sci", "acme") == len(CORPUS)
    old_terms = search(backend, embedder, "acme", "malaria artemisinin", size=5)
    assert "mal" not in ids(old_terms, "bm25")
    assert ids(old_terms, "knn")[0] != "mal"
    new_terms = search(backend, embedder, "acme", "submarine sonar", size=5)
    assert ids(new_terms, "bm25") == ["mal"]
    top = new_terms.hits["knn"][0]
    assert top.document.id == "mal" and top.document.revision == "1"
    expected = embedder.embed_array(["Submarines. Sonar guides submarine navigation."])[0]
    query = embedder.embed_array(["submarine sonar"])[0]
    assert top.score == pytest.approx(float(expected @ query), abs=1e-5)


def test_a_write_by_another_process_is_seen(tmp_path: Path, embedder: OnnxMiniLMEmbedder) -> None:
    backend = EmbeddedBackend(tmp_path)
    load(backend, embedder, "acme", docs_of(CORPUS))
    assert search(backend, embedder, "acme", "zebra migration").hits["bm25"] == []

    writer = textwrap.dedent(
        f"""
        from pathlib import Path
        from worker.adapters.embedded import EmbeddedBackend
        from worker.adapters.embedder import OnnxMiniLMEmbedder
        from worker.core.types import Document
        doc = Document(id="zeb", title="Zebras", text="Zebra migration across the Serengeti.")
        vectors = OnnxMiniLMEmbedder().embed_array(["Zebras. " + doc.text])
        backend = EmbeddedBackend(Path({str(tmp_path)!r}))
        backend.upsert("sci", "acme", [doc], vectors)
        backend.upsert("sci", "acme", [doc], vectors)
        backend.delete_index("sci", "gone")
        """
    )
    subprocess.run([sys.executable, "-c", writer], cwd=REPO_ROOT, check=True, timeout=60)

    results = search(backend, embedder, "acme", "zebra migration", size=3)
    assert ids(results, "bm25") == ["zeb"]
    assert ids(results, "knn")[0] == "zeb"
    assert backend.count("sci", "acme") == len(CORPUS) + 1


def test_deletes_and_vectorless_replacements_leave_the_knn_channel(
    tmp_path: Path, embedder: OnnxMiniLMEmbedder
) -> None:
    backend = EmbeddedBackend(tmp_path)
    load(backend, embedder, "acme", docs_of(CORPUS))
    load(backend, embedder, "rival", docs_of(CORPUS))
    assert len(search(backend, embedder, "rival", "cancer").hits["knn"]) == len(CORPUS)

    assert backend.delete_index("sci", "rival") == len(CORPUS)
    with pytest.raises(IndexNotFound):  # as a name nobody has, acme's vectors or not
        search(backend, embedder, "rival", "cancer")
    backend.upsert("sci", "acme", docs_of({"smoke": CORPUS["smoke"]}), None)
    results = search(backend, embedder, "acme", "lung cancer smoking")
    assert ids(results, "bm25")[0] == "smoke"
    assert "smoke" not in ids(results, "knn")
    assert len(results.hits["knn"]) == len(CORPUS) - 1


def test_threads_share_one_backend(tmp_path: Path) -> None:
    backend = EmbeddedBackend(tmp_path)
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(40, 16)).astype(np.float32)
    backend.upsert("sci", "acme", [Document(id="seed", text="seed words")], vectors[:1])

    def work(worker: int) -> int:
        found = 0
        for i in range(10):
            doc = Document(id=f"w{worker}-{i}", text=f"shared words from worker {worker}")
            backend.upsert("sci", "acme", [doc], vectors[worker * 10 + i : worker * 10 + i + 1])
            query = ChannelQuery(
                "sci", HardFilters("acme"), BOTH, 100, "shared words", vector=vectors[0]
            )
            found = len(backend.retrieve(query).hits["knn"])
        return found

    with ThreadPoolExecutor(max_workers=4) as pool:
        counts = list(pool.map(work, range(4)))
    assert all(11 <= c <= 41 for c in counts)
    final = backend.retrieve(
        ChannelQuery("sci", HardFilters("acme"), BOTH, 100, "shared", vector=vectors[0])
    )
    assert len(final.hits["knn"]) == 41 and len(final.hits["bm25"]) == 40
    backend.close()


def test_a_query_without_usable_terms_has_an_empty_bm25_channel(
    tmp_path: Path, embedder: OnnxMiniLMEmbedder
) -> None:
    backend = EmbeddedBackend(tmp_path)
    load(backend, embedder, "acme", docs_of(CORPUS))
    results = search(backend, embedder, "acme", "... ?! \u00bf")  # no word: no term to match
    assert results.hits["bm25"] == []
    assert len(results.hits["knn"]) == len(CORPUS)
    assert set(results.seconds) == {"bm25", "knn"}


def test_channels_without_vectors_and_for_an_unknown_index(tmp_path: Path) -> None:
    backend = EmbeddedBackend(tmp_path)
    assert backend.channels("sci", "acme") == frozenset()
    backend.upsert("sci", "acme", docs_of(CORPUS), None)
    assert backend.channels("sci", "acme") == frozenset({"bm25"})
    assert backend.channels("sci", "beta") == frozenset()  # acme's index, not beta's
    query = ChannelQuery("missing", HardFilters("acme"), ("bm25",), 10, "vitamin")
    with pytest.raises(IndexNotFound, match="'missing' does not exist"):
        backend.retrieve(query)


def test_knn_is_offered_by_the_tenants_own_vectors(tmp_path: Path) -> None:
    """Another tenant's vectors in the same index name do not make knn the caller's."""
    backend = EmbeddedBackend(tmp_path)
    vectors = np.eye(len(CORPUS), 8, dtype=np.float32) + 0.1
    backend.upsert("sci", "acme", docs_of(CORPUS), vectors)
    backend.upsert("sci", "beta", docs_of(CORPUS), None)
    assert backend.channels("sci", "acme") == frozenset(BOTH)
    assert backend.channels("sci", "beta") == frozenset({"bm25"})
    backend.upsert("sci", "beta", docs_of(CORPUS)[:1], vectors[:1])
    assert backend.channels("sci", "beta") == frozenset(BOTH)


def test_vector_floor_and_vector_validation(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(len(CORPUS), 8)).astype(np.float32)
    backend = EmbeddedBackend(tmp_path, vector_min_similarity=0.99)
    backend.upsert("sci", "acme", docs_of(CORPUS), vectors)
    query = ChannelQuery("sci", HardFilters("acme"), ("knn",), 10, "x", vector=vectors[2] * 3)
    assert [h.document.id for h in backend.retrieve(query).hits["knn"]] == ["mal"]

    with pytest.raises(InvalidRequest) as count:
        backend.upsert("sci", "acme", docs_of(CORPUS), vectors[:2])
    assert count.value.field == "vectors"
    with pytest.raises(InvalidRequest) as dimension:
        backend.upsert("sci", "acme", docs_of(CORPUS), np.ones((len(CORPUS), 4)))
    assert dimension.value.field == "vectors"
    zero = vectors.copy()
    zero[1] = 0.0
    with pytest.raises(InvalidRequest) as row:
        backend.upsert("sci", "acme", docs_of(CORPUS), zero)
    assert row.value.field == "vectors[1]"
    assert backend.count("sci", "acme") == len(CORPUS)


def test_derived_revision_is_stable_and_content_bound() -> None:
    assert derive_revision("t", "x", {"a": 1}) == derive_revision("t", "x", {"a": 1})
    assert derive_revision("t", "x", {"a": 1}) != derive_revision("t", "y", {"a": 1})


@pytest.mark.parametrize("version", [0, 1])  # v1: one index per name, shared by tenants
def test_a_data_dir_of_another_schema_version_is_refused_not_misread(
    tmp_path: Path, version: int
) -> None:
    conn = apsw.Connection(str(tmp_path / "sift.db"))
    conn.execute(f"CREATE TABLE docs(x); PRAGMA user_version={version}")
    conn.close()
    backend = EmbeddedBackend(tmp_path)
    with pytest.raises(ConfigError, match="SIFT_DATA_DIR"):
        backend.channels("docs", "acme")


def test_sift_worker_stops_at_start_on_a_data_dir_of_another_schema(tmp_path: Path) -> None:
    """Not a worker that comes up healthy and fails every job: ``sift worker`` says it and
    exits 2 before it starts a process (nor does it touch Redis: none listens here)."""
    conn = apsw.Connection(str(tmp_path / "sift.db"))
    conn.execute("CREATE TABLE docs(x); PRAGMA user_version=1")
    conn.close()
    run = subprocess.run(
        [sys.executable, "-m", "worker.cli", "worker"],
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            "SIFT_DATA_DIR": str(tmp_path),
            "SIFT_REDIS_URL": "redis://127.0.0.1:9/0",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "schema v1" in run.stderr and "SIFT_DATA_DIR" in run.stderr, run.stderr  # an error
    # and the way on: the upgrade in place, not a new folder (it holds Redis and the dev key)
    told = " ".join(run.stderr.split())
    assert "new directory" not in told and "run `sift embedded-upgrade`" in told, told
    assert "deploy/README.md §8" in told, told


def test_a_data_dir_of_a_schema_with_no_upgrade_is_moved_aside_not_a_new_folder(
    tmp_path: Path,
) -> None:
    conn = apsw.Connection(str(tmp_path / "sift.db"))
    conn.execute("CREATE TABLE docs(x); PRAGMA user_version=7")
    conn.close()
    backend = EmbeddedBackend(tmp_path)
    try:
        with pytest.raises(ConfigError) as refused:
            backend.check()
    finally:
        backend.close()
    told = " ".join(str(refused.value).split())
    assert "schema v7" in told and "move its sift.db" in told, told
    assert "embedded-upgrade" not in told and "deploy/README.md §8" in told, told


def test_equal_scores_order_by_id_in_both_channels_and_a_shared_hit_is_one_document(
    tmp_path: Path,
) -> None:
    backend = EmbeddedBackend(tmp_path)
    ids_in = ["k", "c", "x", "a", "m", "b"]  # inserted out of id order
    same = np.ones((len(ids_in), 4), np.float32)
    other = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)
    backend.upsert("sci", "acme", [Document(id=i, text="twin words") for i in ids_in], same)
    backend.upsert("sci", "acme", [Document(id="z", text="lone words")], other)
    backend.upsert("sci", "rival", [Document(id="0", text="twin words")], same[:1])
    results = backend.retrieve(
        ChannelQuery("sci", HardFilters("acme"), BOTH, 4, "twin", vector=[1.0, 1.0, 1.0, 1.0])
    )
    assert ids(results, "knn") == ["a", "b", "c", "k"]  # a tie cut at the window, by id
    assert ids(results, "bm25") == ["a", "b", "c", "k"]
    knn_docs = {hit.document.id: hit.document for hit in results.hits["knn"]}
    assert all(hit.document is knn_docs[hit.document.id] for hit in results.hits["bm25"])
    wide = backend.retrieve(
        ChannelQuery("sci", HardFilters("acme"), ("knn",), 10, "", vector=[1.0, 1.0, 1.0, 1.0])
    )
    assert ids(wide, "knn") == ["a", "b", "c", "k", "m", "x", "z"]


def test_the_document_cache_stays_bounded_and_evicted_hits_are_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded._caches, "DOCUMENT_CACHE_SIZE", 5)
    backend = EmbeddedBackend(tmp_path)
    docs = [Document(f"d{i}", f"shared word{i}", f"title {i}") for i in range(12)]
    vectors = np.eye(12, dtype=np.float32)
    backend.upsert("idx", "acme", docs, vectors)

    def knn(i: int) -> list[Document]:
        query = ChannelQuery("idx", HardFilters("acme"), ("knn",), 3, "", vector=vectors[i])
        return [hit.document for hit in backend.retrieve(query).hits["knn"]]

    for i in range(12):  # every search reads bodies the small cache has no room for
        assert knn(i)[0] == docs[i]
        assert len(backend._documents) <= 5
    assert knn(0)[0] == docs[0]  # long evicted: read from SQLite again, the same Document
    backend.close()


def test_a_document_searched_often_stays_cached_through_a_stream_of_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache of 5: one document found by every other search, 29 others found once each in
    between. A hit makes it the most recently used, so it is never the one let go: each
    search of it answers the very Document first built. Let go by age, it was read from
    SQLite again after every fifth new one."""
    monkeypatch.setattr(embedded._caches, "DOCUMENT_CACHE_SIZE", 5)
    backend = EmbeddedBackend(tmp_path)
    docs = [Document(f"d{i}", f"text {i}", f"title {i}") for i in range(30)]
    vectors = np.eye(30, dtype=np.float32)
    backend.upsert("idx", "acme", docs, vectors)

    def knn(i: int) -> Document:
        query = ChannelQuery("idx", HardFilters("acme"), ("knn",), 1, "", vector=vectors[i])
        return backend.retrieve(query).hits["knn"][0].document

    hot = knn(0)
    for i in range(1, 30):
        assert knn(i) == docs[i]
        assert knn(0) is hot  # a cache hit, not a Document built again
    assert len(backend._documents) == 5
    backend.close()


def test_the_document_cache_keeps_under_its_byte_budget_at_the_defaults(tmp_path: Path) -> None:
    """Documents at the API's 100,000 characters, of a script CPython stores at 4 bytes a
    character (about 400 KB each): 200 of them, past the budget, go through the cache; it
    keeps the newest under its bytes (by count alone it kept all 80 MB), and every hit is the
    document written, cached or read again."""
    budget = embedded._caches.DOCUMENT_CACHE_BYTES
    n = 200
    wide = "\U0001d518" * 4 + " "  # MATHEMATICAL FRAKTUR CAPITAL U: 4 bytes in a str
    docs = [Document(f"d{i}", f"doc{i} " + wide * 19_998, f"title {i}") for i in range(n)]
    assert sum(sys.getsizeof(d.text) for d in docs) > budget
    backend = EmbeddedBackend(tmp_path)
    vectors = np.eye(n, dtype=np.float32)
    for start in range(0, n, 50):
        backend.upsert("idx", "acme", docs[start : start + 50], vectors[start : start + 50])

    def knn(i: int) -> Document:
        query = ChannelQuery("idx", HardFilters("acme"), ("knn",), 10, "", vector=vectors[i])
        return backend.retrieve(query).hits["knn"][0].document

    for i in range(n):  # each search reads its 10 candidates' bodies, most already cached
        assert knn(i) == docs[i]
    cached = list(backend._documents.values())
    assert sum(sys.getsizeof(d.text) + sys.getsizeof(d.title) for d in cached) <= budget
    assert len(cached) > 10 and cached[-1] in docs  # the newest kept
    assert knn(0) == docs[0]  # long evicted: read from SQLite again, the same Document
    backend.close()


def _unit_rows(n: int, dimension: int, seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, dimension)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_the_vector_cache_keeps_under_its_byte_budget_letting_go_of_the_least_recently_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three tenants' indexes; a budget that holds two blocks. Searching a, b, a again and
    then c lets go of b, the least recently searched (a's search made it the most recent);
    searching b loads it again from SQLite, with the same hits, and lets go of a. Before,
    every block stayed for as long as the process ran."""
    backend = EmbeddedBackend(tmp_path)
    tenants = ("a", "b", "c")
    vectors = {t: _unit_rows(60, 256, seed) for seed, t in enumerate(tenants)}
    for t in tenants:
        docs = [Document(f"{t}{i}", f"text {i}", "") for i in range(60)]
        backend.upsert("idx", t, docs, vectors[t])

    def top(tenant: str, row: int) -> str:
        query = ChannelQuery(
            "idx", HardFilters(tenant), ("knn",), 5, "", vector=vectors[tenant][row]
        )
        return backend.retrieve(query).hits["knn"][0].document.id

    assert top("a", 1) == "a1" and top("b", 2) == "b2"
    two = sum(v.block.matrix.nbytes + v.block.seqs.nbytes for v in backend._vectors.values())
    monkeypatch.setattr(embedded._caches, "VECTOR_CACHE_BYTES", two + two // 4, raising=False)
    assert top("a", 3) == "a3"
    assert top("c", 4) == "c4"
    assert list(backend._vectors) == [("idx", "a"), ("idx", "c")]
    assert top("b", 5) == "b5"  # let go, loaded again: the same hits
    assert list(backend._vectors) == [("idx", "c"), ("idx", "b")]
    cached = [v.block for v in backend._vectors.values()]
    assert backend._vector_bytes == sum(b.nbytes for b in cached) <= two + two // 4
    assert all(b.nbytes > b.matrix.nbytes + b.seqs.nbytes for b in cached)  # strings count
    backend.close()


def test_an_index_alone_past_the_vector_budget_is_kept_for_its_searches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block larger than the whole budget is still kept while it is the one searched (let
    go, each search would load the whole index again), and goes once another is searched."""
    monkeypatch.setattr(embedded._caches, "VECTOR_CACHE_BYTES", 1, raising=False)
    backend = EmbeddedBackend(tmp_path)
    vectors = _unit_rows(20, 8, 0)
    for t in ("a", "b"):
        backend.upsert("idx", t, [Document(f"{t}{i}", "x", "") for i in range(20)], vectors)

    def search(tenant: str) -> None:
        query = ChannelQuery("idx", HardFilters(tenant), ("knn",), 3, "", vector=vectors[0])
        assert backend.retrieve(query).hits["knn"][0].document.id == f"{tenant}0"

    search("a")
    block = backend._vectors[("idx", "a")].block
    search("a")
    assert backend._vectors[("idx", "a")].block is block  # not loaded again
    search("b")
    assert list(backend._vectors) == [("idx", "b")]
    backend.close()


def test_a_vector_load_holds_no_lock_the_process_s_other_operations_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kNN search that loads its index's block (0.34 s of CPU for 100,000 documents, and
    again after each time the budget lets it go) reads SQLite and builds the matrix without
    the backend's lock, which every operation of the process takes to borrow a connection:
    held, another index's BM25 search, a write or a probe in another thread waited for the
    whole load. Seen from inside the load (its matrix's build), the lock is free, the
    index's own load lock is held (two loads of one index would append to the same spare
    rows), and a search of another index runs to its end there."""
    backend = EmbeddedBackend(tmp_path)
    vectors = _unit_rows(20, 8, 0)
    backend.upsert("idx", "acme", [Document(f"d{i}", "x", "") for i in range(20)], vectors)
    backend.upsert("other", "acme", [Document("o1", "needle text", "")], None)
    seen: list[object] = []
    grow = embedded._caches._grow

    def watched(*args: Any) -> Any:
        seen.append(backend._lock.locked())
        if not seen[0] and len(seen) == 1:  # held, this search would wait for ever
            seen.append(backend._load_lock(("idx", "acme")).locked())
            query = ChannelQuery("other", HardFilters("acme"), ("bm25",), 5, "needle")
            seen.append([hit.document.id for hit in backend.retrieve(query).hits["bm25"]])
        return grow(*args)

    monkeypatch.setattr(embedded._caches, "_grow", watched)
    query = ChannelQuery("idx", HardFilters("acme"), ("knn",), 3, "", vector=vectors[4])
    assert backend.retrieve(query).hits["knn"][0].document.id == "d4"
    assert seen == [False, True, ["o1"]]
    backend.close()


def test_a_block_loaded_while_its_index_was_dropped_leaves_at_the_next_knn_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kNN search of k loads k's block outside the backend's lock; meanwhile k is dropped
    and a search of another index sweeps the cache (:meth:`_let_go_of_emptied`), recording
    the drop's schema version while k is not cached yet. The load then stores k's block, read
    from its snapshot before the drop: the dropped documents' vectors, ids and metadata. It
    was kept, counted against the byte budget, until some other index was emptied or made
    (no later sweep ran, the schema unchanged since the one seen); the next kNN search of
    another index lets it go, as it does any dropped index's block."""
    backend = EmbeddedBackend(tmp_path)
    vectors = _unit_rows(3, 8, 0)
    for name in ("k", "j", "l"):
        backend.upsert(name, "acme", [Document(f"{name}{i}", "x", "") for i in range(3)], vectors)

    def knn(index: str) -> list[str]:
        query = ChannelQuery(index, HardFilters("acme"), ("knn",), 3, "", vector=vectors[0])
        return [hit.document.id for hit in backend.retrieve(query).hits["knn"]]

    knn("j"), knn("l")  # another index cached: each search of one sweeps
    inside, go = threading.Event(), threading.Event()
    load = embedded._caches._load

    def paused(conn: apsw.Connection, index: str, *args: Any) -> Any:
        if index == "k":
            inside.set()
            go.wait()
        return load(conn, index, *args)

    monkeypatch.setattr(embedded._caches, "_load", paused)
    with ThreadPoolExecutor(max_workers=2) as pool:
        searched = pool.submit(knn, "k")
        try:
            inside.wait()
            # Committed at once; its WAL checkpoint waits for the search's older snapshot.
            dropped = pool.submit(backend.delete_index, "k", "acme")
            while backend.holds("k", "acme"):
                time.sleep(0.001)
            assert knn("j")[0] == "j0"  # the sweep that sees the drop, k not cached yet
        finally:
            go.set()
        assert searched.result()[0] == "k0"  # its snapshot's, from before the drop
        dropped.result()
    assert ("k", "acme") in backend._vectors  # stored after the sweep
    knn("j")
    assert set(backend._vectors) == {("j", "acme"), ("l", "acme")}
    assert backend._vector_bytes == sum(v.block.nbytes for v in backend._vectors.values())
    backend.close()


def test_searches_in_threads_read_blocks_let_go_under_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget of one byte: every load of one tenant's index lets go of every other's, while
    eight threads search four of them and a ninth writes more documents to one. A block let
    go under a search is the cache's reference dropped, never the rows changed: every search
    finds the document its query vector is (its own row), whatever was let go meanwhile."""
    monkeypatch.setattr(embedded._caches, "VECTOR_CACHE_BYTES", 1, raising=False)
    backend = EmbeddedBackend(tmp_path)
    tenants = [f"t{k}" for k in range(4)]
    vectors = {t: _unit_rows(400, 64, seed) for seed, t in enumerate(tenants)}
    for t in tenants:
        docs = [Document(f"{t}-{i}", f"text {i}", "") for i in range(300)]
        backend.upsert("idx", t, docs, vectors[t][:300])

    def search(job: int) -> list[tuple[str, str]]:
        wrong = []
        for n in range(60):
            t, row = tenants[(job + n) % 4], (job * 7 + n) % 300
            query = ChannelQuery("idx", HardFilters(t), ("knn",), 10, "", vector=vectors[t][row])
            found = backend.retrieve(query).hits["knn"][0].document.id
            if found != f"{t}-{row}":
                wrong.append((found, f"{t}-{row}"))
        return wrong

    def write() -> list[tuple[str, str]]:
        for i in range(300, 400):  # appends grow t0's block, in place when it has room
            backend.upsert("idx", "t0", [Document(f"t0-{i}", "more", "")], vectors["t0"][i : i + 1])
        return []

    with ThreadPoolExecutor(max_workers=9) as pool:
        futures = [pool.submit(search, job) for job in range(8)] + [pool.submit(write)]
        assert [w for f in futures for w in f.result()] == []
    assert len(backend._vectors) == 1  # each load let go of the others
    backend.close()


def test_an_index_keeps_the_embedding_model_its_first_write_recorded(tmp_path: Path) -> None:
    """Vectors of another model are refused, writing nothing, while the tenant's index holds
    a document; the record goes with the last of them, by a drop or by deletes by id."""
    backend = EmbeddedBackend(tmp_path)
    one, other = [[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]
    backend.upsert("sci", "acme", [Document("a", "alpha")], one, model="m-1")
    backend.upsert("sci", "beta", [Document("b", "beta")], one, model="m-2")  # beta's own
    with pytest.raises(EmbeddingModelMismatch, match=r"'m-1'.*'m-2'.*drop") as refused:
        two = [Document("a", "replaced"), Document("c", "new")]
        backend.upsert("sci", "acme", two, other * 2, model="m-2")
    assert refused.value.code == "embedding_model_mismatch" and not refused.value.retryable
    assert backend.count("sci", "acme") == 1  # nothing written, no partial mix
    stored = backend.document("sci", "acme", "a")
    assert stored is not None and stored.text == "alpha"
    assert backend.probe("sci", "acme") == IndexProbe(frozenset(BOTH), "m-1")
    assert backend.probe("sci", "beta").model == "m-2"
    info = backend.index_info("sci", "acme")
    assert info is not None and info.model == "m-1"
    # the same model, or no vectors at all, still writes
    assert backend.upsert("sci", "acme", [Document("c", "new")], other, model="m-1") == 1
    assert backend.upsert("sci", "acme", [Document("d", "plain")], None, model="m-2") == 1

    backend.delete_documents("sci", "acme", ["a", "c"])
    assert backend.probe("sci", "acme").model == "m-1"  # "d" holds the index: the record stays
    with pytest.raises(EmbeddingModelMismatch):
        backend.upsert("sci", "acme", [Document("a", "alpha")], other, model="m-2")
    backend.delete_documents("sci", "acme", ["d"])  # the last one: no index, no record
    assert backend.probe("sci", "acme") == IndexProbe(frozenset())
    assert backend.upsert("sci", "acme", [Document("a", "alpha")], other, model="m-2") == 1
    assert backend.probe("sci", "acme").model == "m-2"

    backend.delete_index("sci", "acme", version=10)
    # a write accepted before the drop is skipped, and records nothing
    assert backend.upsert("sci", "acme", [Document("a", "old")], one, model="m-1", version=9) == 0
    assert (
        backend.upsert("sci", "acme", [Document("a", "new")], other, model="m-2", version=11) == 1
    )
    assert backend.probe("sci", "acme").model == "m-2"
    assert backend.probe("sci", "beta").model == "m-2"  # beta's record was never touched


def test_a_versioned_drop_keeps_the_model_of_documents_it_left(tmp_path: Path) -> None:
    backend = EmbeddedBackend(tmp_path)
    vector = [[1.0, 0.0]]
    backend.upsert("sci", "acme", [Document("a", "x")], vector, model="m-1", version=5)
    backend.upsert("sci", "acme", [Document("b", "y")], vector, model="m-1", version=7)
    assert backend.delete_index("sci", "acme", version=6) == 1  # "b" came after the drop
    assert backend.probe("sci", "acme").model == "m-1"
    with pytest.raises(EmbeddingModelMismatch):
        backend.upsert("sci", "acme", [Document("c", "z")], vector, model="m-2", version=8)


def test_searches_reuse_their_prepared_statements_on_a_many_segment_index(tmp_path: Path) -> None:
    """No statement is compiled again search after search, FTS5's own included.

    SQLite compiles a statement again at each binding of a parameter whose value its plan
    read: without the query-planner stability guarantee the BM25 statement was (its join
    of the FTS5 table with ``docs`` reads the bound index name), and on an index of more
    than one segment (each write transaction adds one) an FTS5 statement of its own, per
    term. The authorizer is asked at each compilation, so it counts them.
    """
    backend = EmbeddedBackend(tmp_path)
    for tenant in ("acme", "beta"):
        for doc in docs_of(CORPUS):  # one transaction, one segment, each
            backend.upsert("sci", tenant, [doc], None)
    queries = ["vitamin fractures", "statins cholesterol", "malaria therapy", "sleep obesity"]

    def run() -> list[list[tuple[str, float]]]:
        return [
            [
                (hit.document.id, hit.score)
                for hit in backend.retrieve(
                    ChannelQuery("sci", HardFilters("acme"), ("bm25",), 10, text)
                ).hits["bm25"]
            ]
            for text in queries
        ]

    first = run()
    compiled: list[tuple[int, str | None]] = []

    def authorizer(
        op: int, one: str | None, two: str | None, db: str | None, view: str | None
    ) -> int:
        compiled.append((op, one))
        return apsw.SQLITE_OK

    (conn,) = backend._connections
    conn.authorizer = authorizer  # expires every prepared statement: compiled once more here
    assert run() == first
    assert compiled  # the authorizer does see compilations
    compiled.clear()
    for _ in range(3):
        assert run() == first
    assert compiled == []
    assert all(hits for hits in first)
    backend.close()


# --- each tenant's index is its own -------------------------------------------------------


def bm25_hits(backend: EmbeddedBackend, tenant: str, text: str) -> list[tuple[str, float]]:
    query = ChannelQuery("sci", HardFilters(tenant), ("bm25",), 10, text)
    return [(hit.document.id, hit.score) for hit in backend.retrieve(query).hits["bm25"]]


def test_another_tenants_documents_change_neither_bm25_scores_nor_ranking(
    tmp_path: Path,
) -> None:
    """BM25's statistics (IDF, average length) are the tenant's own: another tenant writing
    the query's terms into the same index name leaves the caller's scores as they were."""
    backend = EmbeddedBackend(tmp_path)
    mine = {
        "x": ("", "alpha alpha gamma"),
        "y": ("", "beta delta epsilon"),
        **{f"f{i}": ("", f"filler words number {i}") for i in range(6)},
    }
    backend.upsert("sci", "acme", docs_of(mine), None)
    before = bm25_hits(backend, "acme", "alpha beta")
    assert [doc_id for doc_id, _ in before] == ["x", "y"]  # two alphas beat one beta

    theirs = {f"t{i}": ("", f"alpha {'padding ' * (i % 7)}") for i in range(60)}
    backend.upsert("sci", "globex", docs_of(theirs), None)
    assert bm25_hits(backend, "acme", "alpha beta") == before
    assert len(bm25_hits(backend, "globex", "alpha beta")) == 10


def test_tenants_may_use_different_vector_dimensions_under_one_index_name(
    tmp_path: Path,
) -> None:
    backend = EmbeddedBackend(tmp_path)
    wide = np.eye(len(CORPUS), 8, dtype=np.float32) + 0.1
    narrow = np.eye(len(CORPUS), 4, dtype=np.float32) + 0.1
    backend.upsert("sci", "acme", docs_of(CORPUS), wide)
    backend.upsert("sci", "globex", docs_of(CORPUS), narrow)
    for tenant, vectors in (("acme", wide), ("globex", narrow)):
        query = ChannelQuery("sci", HardFilters(tenant), ("knn",), 1, "x", vector=vectors[2])
        assert [h.document.id for h in backend.retrieve(query).hits["knn"]] == ["mal"]
        assert backend.index_info("sci", tenant).dimension == vectors.shape[1]  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest) as dimension:  # each tenant's own claim still holds
        backend.upsert("sci", "globex", docs_of(CORPUS)[:1], wide[:1])
    assert dimension.value.field == "vectors"


def test_dropping_one_tenants_index_leaves_anothers_intact_and_searchable(
    tmp_path: Path,
) -> None:
    backend = EmbeddedBackend(tmp_path)
    vectors = np.eye(len(CORPUS), 8, dtype=np.float32) + 0.1
    for tenant in ("acme", "globex"):
        backend.upsert("sci", tenant, docs_of(CORPUS), vectors)

    def both(tenant: str) -> ChannelResults:
        return backend.retrieve(
            ChannelQuery("sci", HardFilters(tenant), BOTH, 10, "vitamin", vector=vectors[0])
        )

    before = both("globex")
    assert before.hits["bm25"] and before.hits["knn"]
    assert backend.delete_index("sci", "acme") == len(CORPUS)
    after = both("globex")
    for channel in BOTH:
        assert [(h.document.id, h.score) for h in after.hits[channel]] == [
            (h.document.id, h.score) for h in before.hits[channel]
        ]
    assert backend.channels("sci", "globex") == frozenset(BOTH)
    assert backend.count("sci", "globex") == len(CORPUS)
    assert backend.channels("sci", "acme") == frozenset()
    assert backend.index_info("sci", "acme") is None
    # The dropped index holds no vector, so it holds no dimension either: a new model may differ.
    backend.upsert("sci", "acme", docs_of(CORPUS), np.eye(len(CORPUS), 4, dtype=np.float32) + 0.1)
    assert backend.index_info("sci", "acme").dimension == 4  # type: ignore[union-attr]
    assert backend.index_info("sci", "globex").dimension == 8  # type: ignore[union-attr]
