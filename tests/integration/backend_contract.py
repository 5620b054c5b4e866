"""The channel contract every SearchBackend must keep, as one set of tests for all of them.

A test module subclasses :class:`BackendContract` and provides the ``backend`` fixture (and
``index``, a fresh index name). The same assertions then run against the in-memory fake,
the embedded backend, and a live Elasticsearch cluster:

* the tenant filter holds inside both channels;
* metadata filters hold inside both channels;
* an upsert by id replaces the document (text, revision and vector);
* ``channels()`` answers nothing for a missing index and no ``knn`` without vectors;
* index names are private to a tenant: an index only another tenant holds documents in
  answers exactly like one nobody has (``channels()`` empty, and the pipeline's
  ``IndexNotFound`` with the same words), and ``knn`` follows the tenant's own vectors;
* a hybrid search through the pipeline returns hits that carry both channel ranks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from tests.fakes import FakeEmbedder
from worker.constants import MAX_BM25_WORDS
from worker.contract import Channel, FilterValue, SearchSpec
from worker.core.pipeline import PipelineConfig, Prepared, SearchPipeline
from worker.core.ports import SearchBackend
from worker.core.types import Candidate, ChannelQuery, ChannelResults, Document, HardFilters
from worker.errors import IndexLimitReached, IndexNotFound
from worker.queue import lifecycle
from worker.queue.economy.finish import as_stored_now

EMBEDDER = FakeEmbedder()
BOTH: tuple[Channel, ...] = ("bm25", "knn")

CORPUS = [
    Document(
        "vitd",
        "Vitamin D deficiency raises the risk of bone fractures.",
        "Vitamin D",
        "1",
        {"topic": "bones", "year": 2020},
    ),
    Document(
        "calc",
        "Calcium supplements and bone density in older adults.",
        "Calcium",
        "1",
        {"topic": "bones", "year": 2018},
    ),
    Document(
        "stat",
        "Statins lower LDL cholesterol and cardiovascular events.",
        "Statins",
        "1",
        {"topic": "heart", "year": 2020},
    ),
    Document(
        "mal",
        "Artemisinin combination therapy treats malaria.",
        "Malaria",
        "1",
        {"topic": "infection", "year": 2019},
    ),
]


def vectors_of(documents: Sequence[Document]) -> list[list[float]]:
    return EMBEDDER.embed([f"{d.title} {d.text}" for d in documents])


class BackendContract:
    """Subclass as ``TestXxxContract`` and provide the ``backend`` and ``index`` fixtures."""

    def load(
        self,
        backend: SearchBackend,
        index: str,
        tenant: str,
        documents: Sequence[Document] = CORPUS,
        with_vectors: bool = True,
    ) -> None:
        vectors = vectors_of(documents) if with_vectors else None
        assert backend.upsert(index, tenant, documents, vectors) == len(documents)

    def search(
        self,
        backend: SearchBackend,
        index: str,
        tenant: str,
        text: str,
        channels: tuple[Channel, ...] = BOTH,
        size: int = 10,
        **fields: FilterValue,
    ) -> ChannelResults:
        vector = EMBEDDER.embed([text])[0] if "knn" in channels else None
        return backend.retrieve(
            ChannelQuery(
                index=index,
                filters=HardFilters(tenant, fields),
                channels=channels,
                size=size,
                text=text,
                vector=vector,
                timeout_seconds=10.0,
            )
        )

    def test_tenants_never_see_each_other_in_either_channel(
        self, backend: SearchBackend, index: str
    ) -> None:
        self.load(backend, index, "acme")
        other = [Document(d.id, f"beta secret {d.text}", d.title, "9", {}) for d in CORPUS]
        self.load(backend, index, "beta", other)
        results = self.search(backend, index, "acme", "vitamin bone fractures")
        for channel in BOTH:
            assert results.hits[channel], channel
            for hit in results.hits[channel]:
                assert "beta secret" not in hit.document.text
                assert hit.document.revision == "1"
        only_beta = self.search(backend, index, "beta", "secret")
        assert only_beta.hits["bm25"]
        assert all("beta secret" in h.document.text for h in only_beta.hits["bm25"])
        assert all("beta secret" in h.document.text for h in only_beta.hits["knn"])
        # a tenant with no documents finds none: empty channels, or (a backend with an index
        # per tenant: Elasticsearch) no index of its own at all
        try:
            nobody = self.search(backend, index, "gamma", "vitamin bone fractures")
        except IndexNotFound:
            pass
        else:
            assert nobody.hits["bm25"] == [] and nobody.hits["knn"] == []

    def test_metadata_filters_hold_inside_both_channels(
        self, backend: SearchBackend, index: str
    ) -> None:
        self.load(backend, index, "acme")
        heart = self.search(backend, index, "acme", "vitamin bone fractures", topic="heart")
        assert heart.hits["bm25"] == []  # no term matches inside the filtered set
        assert [h.document.id for h in heart.hits["knn"]] == ["stat"]  # k filled from it
        words = self.search(
            backend, index, "acme", "cholesterol", channels=("bm25",), topic="heart"
        )
        assert [h.document.id for h in words.hits["bm25"]] == ["stat"]
        both = self.search(backend, index, "acme", "bone", topic="bones", year=2020)
        assert {h.document.id for h in both.hits["bm25"]} == {"vitd"}
        assert {h.document.id for h in both.hits["knn"]} == {"vitd"}
        assert both.hits["bm25"][0].document.metadata == {"topic": "bones", "year": 2020}

    def test_metadata_filters_compare_json_values(self, backend: SearchBackend, index: str) -> None:
        """A filter matches a metadata value equal to it as a JSON value: numbers by their
        exact value (``5`` is ``5.0``; an integer past 2^53 is not the float next to it), a
        boolean only itself (``true`` is not ``1``), a string only itself (``"5"`` is not
        ``5``, ``"true"`` is not ``true``). Both channels answer the same set."""
        held: dict[str, FilterValue] = {
            "int5": 5,
            "float5": 5.0,
            "float55": 5.5,
            "str5": "5",
            "true": True,
            "one": 1,
            "onef": 1.0,
            "false": False,
            "zero": 0,
            "negzero": -0.0,
            "strtrue": "true",
            "big": 9007199254740993,
            "bigf": 9007199254740992.0,
            "neg": -7,
        }
        documents = [Document(i, f"alpha {i}", "", "1", {"n": v}) for i, v in held.items()]
        documents += [
            Document("none", "alpha none", "", "1", {}),
            Document("dotted", "alpha dotted", "", "1", {"a.b": "x", "n.x": 5}),
        ]
        self.load(backend, index, "acme", documents)
        cases: list[tuple[str, FilterValue, set[str]]] = [
            ("n", 5, {"int5", "float5"}),
            ("n", 5.0, {"int5", "float5"}),
            ("n", 5.5, {"float55"}),
            ("n", "5", {"str5"}),
            ("n", True, {"true"}),
            ("n", 1, {"one", "onef"}),
            ("n", 1.0, {"one", "onef"}),
            ("n", False, {"false"}),
            ("n", 0, {"zero", "negzero"}),
            ("n", -0.0, {"zero", "negzero"}),
            ("n", "true", {"strtrue"}),
            ("n", "True", set()),
            ("n", 9007199254740993, {"big"}),
            ("n", 9007199254740992, {"bigf"}),
            ("n", 9007199254740992.0, {"bigf"}),
            ("n", -7.0, {"neg"}),
            ("a.b", "x", {"dotted"}),
            ("n.x", 5, {"dotted"}),
            ("missing", 5, set()),
        ]
        for key, value, expected in cases:
            hits = self.search(backend, index, "acme", "alpha", size=50, **{key: value}).hits
            for channel in BOTH:
                found = {h.document.id for h in hits[channel]}
                assert found == expected, (key, value, channel, found)
        stored = {h.document.id: h.document.metadata for h in hits["bm25"]}
        assert stored == {}  # the last case matches nothing
        both = self.search(backend, index, "acme", "alpha", size=50, n=5.0).hits["bm25"]
        assert {h.document.id: h.document.metadata["n"] for h in both} == {"int5": 5, "float5": 5.0}
        assert {type(h.document.metadata["n"]) for h in both} == {int, float}

    def test_upsert_by_id_replaces_text_revision_and_vector(
        self, backend: SearchBackend, index: str
    ) -> None:
        self.load(backend, index, "acme")
        replaced = Document(
            "vitd",
            "Sunlight exposure and mood in winter.",
            "Sunlight",
            "2",
            {"topic": "mood", "year": 2024},
        )
        self.load(backend, index, "acme", [replaced])
        old = self.search(backend, index, "acme", "vitamin fractures", channels=("bm25",))
        assert "vitd" not in [h.document.id for h in old.hits["bm25"]]
        new = self.search(backend, index, "acme", "sunlight mood winter")
        for channel in BOTH:
            ids = [h.document.id for h in new.hits[channel]]
            assert ids.count("vitd") == 1, channel
            assert ids[0] == "vitd", channel
            assert new.hits[channel][0].document.revision == "2"

    def test_channels_without_vectors_and_for_a_missing_index(
        self, backend: SearchBackend, index: str
    ) -> None:
        assert backend.channels(index, "acme") == frozenset()
        self.load(backend, index, "acme", with_vectors=False)
        assert backend.channels(index, "acme") == frozenset({"bm25"})
        results = self.search(backend, index, "acme", "statins cholesterol", channels=("bm25",))
        assert results.hits["bm25"][0].document.id == "stat"

    def test_an_index_only_another_tenant_has_answers_like_one_nobody_has(
        self, backend: SearchBackend, index: str
    ) -> None:
        self.load(backend, index, "acme")
        nobody = f"{index}-nobody"
        assert backend.channels(index, "acme") == frozenset(BOTH)
        assert backend.channels(index, "beta") == frozenset()
        assert backend.channels(nobody, "beta") == frozenset()
        pipeline = SearchPipeline(backend, EMBEDDER, config=PipelineConfig())
        answers: dict[str, set[tuple[str, str, bool]]] = {index: set(), nobody: set()}
        for name in (index, nobody):
            for mode in ("fts", "vector", "hybrid"):
                spec = SearchSpec(index=name, query="vitamin bone", mode=mode, rerank=False)
                with pytest.raises(IndexNotFound) as caught:
                    pipeline.search(spec, tenant="beta")
                error = caught.value
                # the name is the caller's own input; every other word must match
                answers[name].add(
                    (error.code, error.message.replace(repr(name), "NAME"), error.retryable)
                )
        assert answers[index] == answers[nobody]
        assert len(answers[index]) == 1
        # once beta writes its own documents (no vectors) the index is beta's too: its own
        # channels, not acme's knn
        self.load(backend, index, "beta", CORPUS[:1], with_vectors=False)
        assert backend.channels(index, "beta") == frozenset({"bm25"})
        result = pipeline.search(SearchSpec(index=index, query="vitamin", mode="fts"), "beta")
        assert [hit.id for hit in result.hits] == ["vitd"]

    def test_hybrid_search_through_the_pipeline_keeps_both_channel_ranks(
        self, backend: SearchBackend, index: str
    ) -> None:
        self.load(backend, index, "acme")
        assert backend.channels(index, "acme") == frozenset(BOTH)
        pipeline = SearchPipeline(backend, EMBEDDER, config=PipelineConfig())
        result = pipeline.search(
            SearchSpec(index=index, query="vitamin D bone fractures", limit=3), tenant="acme"
        )
        assert result.hits and result.hits[0].id == "vitd"
        top = result.hits[0]
        assert top.ranks.bm25 == 1 and top.ranks.knn == 1 and top.ranks.rrf == 1
        assert top.ranks.final == 1 and top.scores.rrf == pytest.approx(2 / 61)
        assert top.scores.bm25 is not None and top.scores.knn is not None
        assert [h.ranks.final for h in result.hits] == list(range(1, len(result.hits) + 1))

    def test_the_bm25_channel_reads_the_first_words_of_a_long_query(
        self, backend: SearchBackend, index: str
    ) -> None:
        """Both backends' BM25 channels read a query's first ``MAX_BM25_WORDS`` words
        (Elasticsearch refused a search of more leaf clauses than a small node allows): a
        word past them is not searched by BM25, one among them is."""
        self.load(backend, index, "acme")
        pipeline = SearchPipeline(backend, EMBEDDER, config=PipelineConfig())
        filler = [f"zq{n}" for n in range(MAX_BM25_WORDS)]

        def fts(words: list[str]) -> list[str]:
            spec = SearchSpec(index=index, query=" ".join(words), mode="fts")
            return [hit.id for hit in pipeline.search(spec, "acme").hits]

        assert fts([*filler[:-1], "malaria"]) == ["mal"]
        assert fts([*filler, "malaria"]) == []


class LifecycleContract(BackendContract):
    """The index lifecycle (:class:`~worker.core.ports.IndexCatalog`) on top of the channel
    contract, for the real backends: delete by id and a tenant's index from both channels,
    versioned writes (a drop's included), and list, count and get, always the tenant's
    own. Subclasses also provide ``another``: another worker process's backend on the same
    store (with memos of its own)."""

    #: A write run again after a newer write of its ids counts what its first run wrote (the
    #: embedded backend keeps each write's count in its transaction); Elasticsearch, with no
    #: such transaction, counts the ids that still hold its version.
    counts_first_run = False

    def all_ids(self, backend: SearchBackend, index: str, tenant: str) -> tuple[set[str], set[str]]:
        if not backend.channels(index, tenant):
            return set(), set()
        hits = self.search(
            backend, index, tenant, "vitamin calcium statins malaria bone", size=50
        ).hits
        return {h.document.id for h in hits["bm25"]}, {h.document.id for h in hits["knn"]}

    def test_delete_by_id_leaves_both_channels_and_the_other_tenant(
        self, backend: Any, index: str
    ) -> None:
        self.load(backend, index, "acme")
        self.load(backend, index, "globex")
        assert backend.delete_documents(index, "acme", ["vitd", "calc", "nope"], version=None) == 2
        rest = {"stat", "mal"}
        bm25, knn = self.all_ids(backend, index, "acme")
        assert rest >= bm25 and knn == rest
        assert backend.document(index, "acme", "vitd") is None
        assert backend.document(index, "globex", "vitd") is not None
        assert backend.index_info(index, "acme").documents == 2
        assert backend.index_info(index, "globex").documents == len(CORPUS)

    def test_an_index_emptied_by_deletes_reads_like_a_missing_one(
        self, backend: Any, index: str
    ) -> None:
        """The tenant's last documents deleted by id (right after a search, so a backend
        that remembers a probe has just answered one): its channels are empty, every mode
        fails ``index_not_found`` as for a name nobody has, and it is not listed."""
        self.load(backend, index, "acme")
        pipeline = SearchPipeline(backend, EMBEDDER, config=PipelineConfig())
        assert pipeline.search(SearchSpec(index=index, query="vitamin"), "acme").hits
        assert backend.delete_documents(index, "acme", [d.id for d in CORPUS]) == len(CORPUS)
        assert backend.channels(index, "acme") == frozenset()
        for mode in ("fts", "vector", "hybrid"):
            spec = SearchSpec(index=index, query="vitamin", mode=mode, rerank=False)
            with pytest.raises(IndexNotFound):
                pipeline.search(spec, tenant="acme")
        assert backend.index_info(index, "acme") is None
        assert index not in {i.name for i in backend.indexes("acme")}

    def test_a_versioned_write_older_than_the_held_one_is_skipped(
        self, backend: Any, index: str
    ) -> None:
        doc = [CORPUS[0]]
        assert backend.upsert(index, "acme", doc, vectors_of(doc), version=10) == 1
        assert backend.delete_documents(index, "acme", ["vitd"], version=5) == 0  # older
        assert backend.document(index, "acme", "vitd") is not None
        assert backend.delete_documents(index, "acme", ["vitd"], version=12) == 1
        assert backend.upsert(index, "acme", doc, vectors_of(doc), version=11) == 0  # older
        assert backend.document(index, "acme", "vitd") is None
        assert backend.upsert(index, "acme", doc, vectors_of(doc), version=13) == 1
        assert backend.document(index, "acme", "vitd").text == CORPUS[0].text

    def test_a_versioned_write_run_again_reports_the_documents_it_holds(
        self, backend: Any, index: str
    ) -> None:
        """A write run again with its own version (a job's retry, a redelivery) changes
        nothing and reports its documents written, as the first run did: on Elasticsearch a
        retry after a partial bulk failure finds some of them already there. Once a newer
        write of one of them ran, that one is counted only where the backend kept the first
        run's count (:attr:`counts_first_run`)."""
        self.load(backend, index, "acme")
        assert backend.upsert(index, "acme", CORPUS, vectors_of(CORPUS), version=20) == 4
        assert backend.upsert(index, "acme", CORPUS, vectors_of(CORPUS), version=20) == 4
        assert backend.index_info(index, "acme").documents == len(CORPUS)
        assert backend.delete_documents(index, "acme", ["vitd"], version=21) == 1
        again = backend.upsert(index, "acme", CORPUS, vectors_of(CORPUS), version=20)
        assert again == (4 if self.counts_first_run else 3)
        assert backend.document(index, "acme", "vitd") is None

    def test_an_upsert_accepted_before_a_drop_and_run_after_it_is_skipped(
        self, backend: Any, index: str
    ) -> None:
        """A retry or redelivery of an ingest accepted before the drop writes nothing back,
        nor brings the index back; one accepted after the drop is written."""
        doc = [CORPUS[0]]
        assert backend.upsert(index, "acme", doc, vectors_of(doc), version=10) == 1
        assert backend.delete_index(index, "acme", version=12) == 1
        assert backend.upsert(index, "acme", doc, vectors_of(doc), version=11) == 0
        assert backend.delete_documents(index, "acme", ["vitd"], version=11) == 0
        assert backend.index_info(index, "acme") is None
        assert index not in {i.name for i in backend.indexes("acme")}
        assert backend.channels(index, "acme") == frozenset()
        assert backend.upsert(index, "acme", doc, vectors_of(doc), version=13) == 1
        assert backend.index_info(index, "acme").documents == 1

    def test_an_upsert_accepted_after_a_drop_and_run_before_it_stays(
        self, backend: Any, index: str
    ) -> None:
        """The last accepted write wins whichever worker runs it first: an ingest accepted
        after the drop (13 after 12) whose job runs before the drop's keeps its documents;
        the drop takes only what was written before it (10), and is counted so."""
        old, new = [CORPUS[0]], [CORPUS[1]]
        assert backend.upsert(index, "acme", old, vectors_of(old), version=10) == 1
        assert backend.upsert(index, "acme", new, vectors_of(new), version=13) == 1
        assert backend.delete_index(index, "acme", version=12) == 1
        assert backend.document(index, "acme", old[0].id) is None
        assert backend.document(index, "acme", new[0].id) is not None
        assert backend.index_info(index, "acme").documents == 1
        assert self.all_ids(backend, index, "acme") == ({new[0].id}, {new[0].id})
        # the drop's retry (a redelivery) takes nothing more; a later drop takes the rest
        backend.delete_index(index, "acme", version=12)
        assert backend.document(index, "acme", new[0].id) is not None
        assert backend.delete_index(index, "acme", version=14) == 1
        assert backend.index_info(index, "acme") is None

    def test_a_delete_accepted_after_a_drop_and_run_before_it_still_wins(
        self, backend: Any, index: str
    ) -> None:
        """Drop 12, then an ingest of ``vitd`` (13), then its delete (14) are accepted; the
        delete's job runs first, then the drop's, then the ingest's: the delete, accepted
        last, wins (the drop takes nothing of what the delete recorded)."""
        doc = [CORPUS[0]]
        assert backend.upsert(index, "acme", doc, vectors_of(doc), version=10) == 1
        assert backend.delete_documents(index, "acme", [doc[0].id], version=14) == 1
        assert backend.delete_index(index, "acme", version=12) == 0
        assert backend.upsert(index, "acme", doc, vectors_of(doc), version=13) == 0
        assert backend.document(index, "acme", doc[0].id) is None
        assert self.all_ids(backend, index, "acme") == (set(), set())

    def test_delete_index_is_the_tenants_only(self, backend: Any, index: str) -> None:
        self.load(backend, index, "acme")
        self.load(backend, index, "globex")
        assert backend.delete_index(index, "acme", version=None) == len(CORPUS)
        assert backend.channels(index, "acme") == frozenset()
        assert backend.index_info(index, "acme") is None
        assert backend.index_info(index, "globex").documents == len(CORPUS)
        assert self.all_ids(backend, index, "globex")[1] == {d.id for d in CORPUS}
        self.load(backend, index, "acme", CORPUS[:1])  # the name works again
        assert backend.index_info(index, "acme").documents == 1

    @pytest.mark.parametrize("gone_by", ["a drop", "deletes by id"])
    def test_an_item_finished_after_its_index_went_elsewhere_is_index_not_found(
        self, backend: Any, another: Any, index: str, gone_by: str
    ) -> None:
        """An economy item finishes hours after its retrieval, in the worker polling its
        provider batch; the index may have gone meanwhile, by a drop or deletes run in
        another worker process. The finish asked :meth:`channels` whether it still existed,
        which Elasticsearch answers from this process's memo of the index's vectors for a
        minute: the item succeeded with no hit instead of ending ``index_not_found``. The
        question is now asked of the store itself."""
        self.load(backend, index, "acme")
        self.load(backend, index, "globex")
        assert backend.probe(index, "acme").channels == frozenset(BOTH)  # as a search asks
        candidates = [Candidate(d, rank, 0.1, {}, {}) for rank, d in enumerate(CORPUS, 1)]
        item = Prepared(SearchSpec(index=index, query="bone"), candidates, {})
        another.delete_documents(index, "acme", ["vitd"], version=None)
        [held] = as_stored_now(backend, "acme", [item])
        assert isinstance(held, Prepared) and held.gone == {"vitd"}, held
        if gone_by == "a drop":
            another.delete_index(index, "acme", version=None)
        else:
            another.delete_documents(index, "acme", [d.id for d in CORPUS], version=None)
        [held] = as_stored_now(backend, "acme", [item])
        assert isinstance(held, IndexNotFound), held
        [theirs] = as_stored_now(backend, "globex", [item])  # another tenant's is there
        assert isinstance(theirs, Prepared) and not theirs.gone, theirs

    def test_a_tenant_holds_at_most_its_limit_of_indexes(self, backend: Any, index: str) -> None:
        """A write that would make one index more than ``max_indexes_per_tenant`` fails
        ``index_limit_reached`` (not retried), writing nothing; the tenant's indexes still
        take writes, another tenant's count is its own, and a drop frees a place."""
        backend.max_indexes_per_tenant = 2
        names = [f"{index}-held-{i}" for i in range(3)]
        try:
            self.load(backend, names[0], "acme", CORPUS[:1])
            self.load(backend, names[1], "acme", CORPUS[:1])
            with pytest.raises(IndexLimitReached) as refused:
                self.load(backend, names[2], "acme", CORPUS[:1])
            assert refused.value.code == "index_limit_reached" and not refused.value.retryable
            assert "holds 2 indexes" in refused.value.message
            assert "SIFT_MAX_INDEXES_PER_TENANT (2)" in refused.value.message
            assert backend.document(names[2], "acme", CORPUS[0].id) is None
            assert [i.name for i in backend.indexes("acme")] == names[:2]
            self.load(backend, names[0], "acme", CORPUS[1:3])  # one it holds takes more
            self.load(backend, names[2], "globex", CORPUS[:1])  # another tenant: its own count
            backend.delete_index(names[0], "acme")
            self.load(backend, names[2], "acme", CORPUS[:1])
            assert [i.name for i in backend.indexes("acme")] == names[1:]
        finally:
            for name in names:
                for tenant in ("acme", "globex"):
                    backend.delete_index(name, tenant)

    def test_index_settings_are_the_tenants_and_the_newer_version_wins(
        self, backend: Any, index: str
    ) -> None:
        """Where an index's own settings last (:class:`~worker.core.ports.IndexSettingsStorage`):
        kept by the backend, so a Redis that comes back empty loses none."""
        assert backend.stored_settings([index], "acme") == [None]
        assert backend.store_settings(index, "acme", {"candidate_limit": 40}, 10)
        assert backend.stored_settings([index], "acme") == [({"candidate_limit": 40}, 10)]
        assert backend.stored_settings([index], "globex") == [None]
        assert not backend.store_settings(index, "acme", {"candidate_limit": 5}, 9)  # older
        assert not backend.store_settings(index, "acme", {"candidate_limit": 5}, 10)
        assert backend.store_settings(index, "acme", None, 12)  # cleared by a drop of 12
        assert backend.stored_settings([index], "acme") == [(None, 12)]
        assert not backend.store_settings(index, "acme", {"candidate_limit": 5}, 11)
        weights = {"fusion": {"weights": {"knn": 0.25}}}
        assert backend.store_settings(index, "acme", weights, 13)
        assert backend.store_settings("other", "acme", {"candidate_limit": 7}, 14)
        assert backend.stored_settings([index, "none", "other"], "acme") == [
            (weights, 13),
            None,
            ({"candidate_limit": 7}, 14),
        ]
        assert backend.stored_settings([], "acme") == []

    def test_the_longest_ids_the_gateway_accepts_are_written_found_read_and_deleted(
        self, backend: Any, index: str
    ) -> None:
        """The gateway takes a document id of up to 512 characters: 2,048 bytes in UTF-8 for
        four-byte characters, 517 with Elasticsearch's ``acme:`` prefix for an ASCII one (ES
        refuses an ``_id`` over 512 bytes). Each is written, found in both channels, read,
        deleted by id, and its delete still refuses an older upsert; a short id beside them,
        and another tenant's document of the same long id, are left alone."""
        longest = [
            Document("𝔡" * 512, CORPUS[0].text, CORPUS[0].title),
            Document("d" * 512, CORPUS[1].text, CORPUS[1].title),
        ]
        ids = {doc.id for doc in longest}
        written = [*longest, CORPUS[2]]
        assert backend.upsert(index, "acme", written, vectors_of(written), version=10) == 3
        assert backend.upsert(index, "globex", longest[:1], vectors_of(longest[:1])) == 1
        for doc in longest:
            hits = self.search(backend, index, "acme", f"{doc.title} {doc.text}").hits
            assert doc.id in {h.document.id for h in hits["bm25"]}
            assert hits["knn"][0].document.id == doc.id
            stored = backend.document(index, "acme", doc.id)
            assert (stored.id, stored.text, stored.title) == (doc.id, doc.text, doc.title)
        assert backend.document(index, "acme", "d" * 511) is None  # its neighbour is not it
        assert backend.delete_documents(index, "acme", sorted(ids), version=12) == 2
        assert backend.upsert(index, "acme", longest, vectors_of(longest), version=11) == 0
        assert all(backend.document(index, "acme", i) is None for i in ids)
        assert self.all_ids(backend, index, "acme")[1] == {CORPUS[2].id}
        assert backend.document(index, "globex", longest[0].id).text == CORPUS[0].text

    def test_indexes_page_by_name_after_a_cursor(self, backend: Any, index: str) -> None:
        """``indexes(tenant, after, limit)``: up to ``limit`` of the tenant's indexes named
        after ``after``, by name, whatever became of the index ``after`` names; another
        tenant's never, even between the tenant's own."""
        names = [f"{index}-{c}" for c in "abcd"]
        for name in names:
            self.load(backend, name, "acme", CORPUS[:1])
        self.load(backend, f"{index}-bb", "globex", CORPUS[:1])

        def ours(after: str | None, limit: int | None, tenant: str = "acme") -> list[str]:
            found = backend.indexes(tenant, after, limit)
            assert [i.name for i in found] == sorted(i.name for i in found)
            return [i.name for i in found if i.name.startswith(index)]

        assert ours(None, None) == names
        assert ours(names[0], 2) == names[1:3]
        assert ours(names[3], None) == [] and ours(names[3], 5) == []
        assert ours(names[0], None, "globex") == [f"{index}-bb"]
        assert backend.delete_index(names[1], "acme") == 1  # the cursor's own index gone
        assert ours(names[1], 1) == [names[2]]
        assert ours(names[0], 1) == [names[2]]
        for name in names:
            backend.delete_index(name, "acme")
        assert ours(names[0], None) == []

    def test_list_count_and_get_are_the_tenants(self, backend: Any, index: str) -> None:
        self.load(backend, index, "acme")
        listed = {i.name: i for i in backend.indexes("acme")}
        assert listed[index].documents == len(CORPUS) and listed[index].backend == backend.name
        assert index not in {i.name for i in backend.indexes("nobody-at-all")}
        assert backend.index_info(index, "globex") is None
        assert backend.index_info(f"{index}-none", "acme") is None
        doc = backend.document(index, "acme", "vitd")
        assert (doc.id, doc.text, doc.title, doc.revision) == (
            "vitd",
            CORPUS[0].text,
            "Vitamin D",
            "1",
        )
        assert dict(doc.metadata) == {"topic": "bones", "year": 2020}
        assert backend.document(index, "globex", "vitd") is None
        assert backend.document(f"{index}-none", "acme", "vitd") is None

    def test_stored_documents_are_the_tenants_own_as_stored_now(
        self, backend: Any, index: str
    ) -> None:
        """The documents of many ids in one read (an economy item's candidates, checked at
        its finish): each as a read of it alone answers, those deleted or never written left
        out, another tenant's never."""
        self.load(backend, index, "acme")
        self.load(backend, index, "globex")
        ids = [doc.id for doc in CORPUS]
        stored = backend.stored_documents(index, "acme", [*ids, "never-written"])
        assert sorted(stored) == sorted(ids)
        assert all(stored[i] == backend.document(index, "acme", i) for i in ids)
        backend.delete_documents(index, "acme", [ids[0]])
        assert sorted(backend.stored_documents(index, "acme", ids)) == sorted(ids[1:])
        assert sorted(backend.stored_documents(index, "globex", ids)) == sorted(ids)
        assert backend.stored_documents(index, "nobody-at-all", ids) == {}
        assert backend.stored_documents(f"{index}-none", "acme", ids) == {}
        assert backend.stored_documents(index, "acme", []) == {}

    def test_a_document_read_tells_a_missing_index_from_a_missing_document(
        self, backend: Any, index: str
    ) -> None:
        """The worker's document read (what ``GET /v1/indexes/{index}/documents/{id}``
        answers): a document its index lacks is None, an index the tenant lacks is the
        ``index_not_found`` that showing or listing it answers, the same words whether
        another tenant uses the name or nobody does (it was None for both: a 404 naming
        the id)."""
        self.load(backend, index, "acme")
        runtime = SimpleNamespace(pipeline=SimpleNamespace(backend=backend))

        def read(tenant: str, name: str, doc_id: str) -> Any:
            return json.loads(lifecycle.read(runtime, "document", tenant, name, doc_id))

        assert read("acme", index, "vitd")["found"]["text"] == CORPUS[0].text
        assert read("acme", index, "nope") == {"found": None}
        theirs, nobodys = read("globex", index, "vitd"), read("globex", f"{index}-none", "vitd")
        assert theirs["error"]["type"] == "index_not_found", theirs
        assert theirs["error"]["message"].replace(index, "NAME") == nobodys["error"][
            "message"
        ].replace(f"{index}-none", "NAME")

    def test_documents_page_by_id_the_tenants_own(self, backend: Any, index: str) -> None:
        """The tenant's documents a page at a time, by id (code point order: ``"Z"`` before
        ``"a"``, a four-byte character last), each page starting after the last id of the
        one before, with no repeat and no gap; the text as a preview and its length, never
        the vector; another tenant's documents of the same ids never; an index the tenant
        does not hold (another's, or nobody's) None, a page past the last document empty."""
        long_text = "word " * 100  # 500 characters: the listing shows the first 200
        ids = ["a", "b-2", "b-10", "Z", "𝔡", "c/d e"]
        mine = [
            Document(i, f"{CORPUS[n % 4].text} {long_text}", f"T{n}", str(n), {"n": n})
            for n, i in enumerate(ids)
        ]
        self.load(backend, index, "acme", mine)
        self.load(backend, index, "globex", CORPUS)
        self.load(backend, index, "globex", [Document("a", "globex's a", "G", "9", {})])
        pages: list[list[Any]] = []
        after = None
        while page := backend.documents(index, "acme", after, 4 if not pages else 2):
            pages.append(page)
            after = page[-1].id
        assert [len(p) for p in pages] == [4, 2]
        listed = [doc for page in pages for doc in page]
        assert [d.id for d in listed] == sorted(ids) == ["Z", "a", "b-10", "b-2", "c/d e", "𝔡"]
        by_id = {d.id: d for d in listed}
        for n, doc in enumerate(mine):
            shown = by_id[doc.id]
            assert (shown.title, shown.revision, dict(shown.metadata)) == (
                f"T{n}",
                str(n),
                {"n": n},
            )
            assert shown.text_length == len(doc.text) and shown.text_preview == doc.text[:200]
            assert shown.version == backend.document(index, "acme", doc.id).version
            assert not hasattr(shown, "vector")
        assert backend.documents(index, "acme", "𝔡", 10) == []
        assert backend.documents(index, "acme", "b-2", 1)[0].id == "c/d e"
        assert [d.id for d in backend.documents(index, "globex", None, 10)] == sorted(
            [d.id for d in CORPUS] + ["a"]
        )
        (theirs,) = backend.documents(index, "globex", None, 1)
        assert (theirs.id, theirs.text_preview, theirs.title) == ("a", "globex's a", "G")
        assert backend.documents(index, "beta", None, 10) is None
        assert backend.documents(f"{index}-none", "acme", None, 10) is None
        assert backend.documents(f"{index}-none", "acme", "a", 10) is None
        assert backend.delete_documents(index, "acme", ["a", "Z"]) == 2
        assert [d.id for d in backend.documents(index, "acme", None, 10)] == sorted(ids)[2:]
        assert (
            len(backend.documents(index, "acme", None, 10))
            == backend.index_info(index, "acme").documents
        )
        assert backend.delete_documents(index, "acme", sorted(ids)[2:]) == 4
        assert backend.documents(index, "acme", None, 10) is None
        assert backend.documents(index, "acme", "b-2", 10) is None

    def test_a_listed_preview_counts_characters_outside_the_bmp_once(
        self, backend: Any, index: str
    ) -> None:
        """The preview is the text's first 200 characters (code points, as Python slices)
        and the length counts characters, on every backend. Elasticsearch computes both in
        painless, whose strings are UTF-16: there a character outside the BMP (an emoji,
        "𝔡") is two units, so a cut at 200 units stops at 100 of them or splits a pair, and
        a length in units counts each twice."""
        texts = {
            "astral": "😀" * 250,
            "straddle": "a" * 199 + "𝔡" + "b" * 50,
            "exact": "𝔡" * 200,
            "mixed": "é😀 " * 70,
            "short": "é😀",
        }
        self.load(backend, index, "acme", [Document(i, t, "T", "1", {}) for i, t in texts.items()])
        listed = backend.documents(index, "acme", None, 10)
        assert {d.id: (d.text_preview, d.text_length) for d in listed} == {
            i: (t[:200], len(t)) for i, t in texts.items()
        }

    def test_a_listed_text_with_a_nul_is_shown_whole(self, backend: Any, index: str) -> None:
        """A text may hold U+0000 (valid JSON, taken by the ingest). SQLite's ``length`` and
        ``substr`` stop at the first NUL: the embedded listing showed ``"ab"`` and a length of
        2 for a 300-character text that the document's read and Elasticsearch show whole."""
        text = "ab\x00cd é " + "z" * 300
        self.load(backend, index, "acme", [Document("nul", text, "T", "1", {})])
        (listed,) = backend.documents(index, "acme", None, 10)
        assert backend.document(index, "acme", "nul").text == text
        assert (listed.text_preview, listed.text_length) == (text[:200], len(text))
