"""A search's first half as plain data (:class:`Prepared`), the digest of the candidates the
model is shown, and the prepared search as JSON for a lane that finishes it later."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from worker.constants import POLICY_ID
from worker.contract import FilterValue, SearchResult, SearchSpec, StoredValue
from worker.core.catalog import StoredDocument
from worker.core.pipeline._hits import _trace_candidates
from worker.core.policy import shown_head
from worker.core.types import Candidate, Document, RerankPrompt

if TYPE_CHECKING:
    from worker.core.pipeline._search import SearchPipeline


@dataclass(slots=True)
class Prepared:
    """The first half of a search, up to the model call, as plain data.

    ``result`` is set when no model call is needed (no rerank, or no candidates): it is final;
    ``skipped`` when a rerank was asked for and had no candidates (its outcome to count).
    Otherwise ``prompt`` is what to send, and :meth:`SearchPipeline.finish` turns the model's
    answer (or the failure) into the result. ``seconds`` is the time the first half took.
    ``trace`` lists the candidates only when the search asked for its trace
    (``include_trace``): otherwise no one reads it, and it is a dict per candidate.
    ``gone``: the candidates' ids deleted since their retrieval, or written again outside
    the search's filters (those also in ``filtered_out``) (:func:`as_stored`), in no hit.
    ``policy``: the prompt policy of the prompt the answer is to, which names the rerank in
    the result and its metrics: this release's, but an economy item prepared, or sent, by an
    older release may have had an older one's (:func:`load_prepared`).
    """

    spec: SearchSpec
    candidates: list[Candidate]
    trace: dict[str, Any]
    prompt: RerankPrompt | None = None
    result: SearchResult | None = None
    skipped: bool = False
    seconds: float = 0.0
    gone: frozenset[str] = field(default_factory=frozenset)
    filtered_out: frozenset[str] = field(default_factory=frozenset)
    policy: str = POLICY_ID


def as_stored(
    prepared: Prepared,
    stored: Mapping[str, StoredDocument],
    holds: Callable[[StoredDocument, Mapping[str, FilterValue]], bool] | None = None,
) -> Prepared:
    """``prepared`` with its candidates' documents as ``stored`` holds them now: a search
    finished long after its retrieval (an economy item waits hours at most on its provider
    batch) returns nothing a delete finished meanwhile removed, and no text an upsert
    replaced. A candidate whose id ``stored`` lacks is ``gone``: in no hit, fallback or trace
    (the trace names its id in ``deleted_since_retrieval``); so is one written again with
    metadata the search's ``filters`` no longer keep (``holds``: the backend's
    :meth:`~worker.core.ports.SearchBackend.holds_filters`, compared as its filters compare;
    :func:`holds_filters` by default; the trace names it in
    ``filtered_out_since_retrieval``), which its retrieval, filtered, would not find now.
    The prompt stays as it was sent: the model's positions refer to it.

    >>> old = Candidate(Document("a", "old text", revision="1"), 1, 0.1, {}, {})
    >>> other = Candidate(Document("b", "b's text", revision="1"), 2, 0.1, {}, {})
    >>> prepared = Prepared(SearchSpec(index="i", query="q"), [old, other], {})
    >>> now = as_stored(prepared, {"a": StoredDocument("a", "new text", "", "2")})
    >>> now.candidates[0].document.text, now.gone, now.trace["deleted_since_retrieval"]
    ('new text', frozenset({'b'}), ['b'])
    >>> public = replace(prepared, spec=SearchSpec(index="i", query="q", filters={"vis": "pub"}))
    >>> now = as_stored(public, {"a": StoredDocument("a", "x", "", "2", {"vis": "private"}),
    ...                          "b": StoredDocument("b", "y", "", "2", {"vis": "pub"})})
    >>> now.gone, now.trace["filtered_out_since_retrieval"], "deleted_since_retrieval" in now.trace
    (frozenset({'a'}), ['a'], False)
    """
    candidates = [
        replace(c, document=_document(held)) if (held := stored.get(c.document.id)) else c
        for c in prepared.candidates
    ]
    deleted = {c.document.id for c in candidates if c.document.id not in stored}
    filters = prepared.spec.filters
    kept = holds or _holds_filters
    filtered = {
        c.document.id
        for c in candidates
        if (held := stored.get(c.document.id)) is not None and not kept(held, filters)
    }
    gone = frozenset(deleted | filtered)
    trace = dict(prepared.trace)
    if deleted:
        trace["deleted_since_retrieval"] = sorted(deleted)
    if filtered:
        trace["filtered_out_since_retrieval"] = sorted(filtered)
    if "candidates" in trace:
        chars = int(trace["candidate_max_chars"])
        shown = _trace_candidates(candidates, prepared.prompt, chars)
        trace["candidates"] = [c for c in shown if c["id"] not in gone]
    return replace(
        prepared, candidates=candidates, trace=trace, gone=gone, filtered_out=frozenset(filtered)
    )


def holds_filters(metadata: Mapping[str, StoredValue], filters: Mapping[str, FilterValue]) -> bool:
    """Whether ``metadata`` holds every key of ``filters`` with an equal value, compared as
    JSON values as the backends' filters compare a document Sift wrote (docs/architecture.md,
    "Metadata filters"): a boolean only itself, a string only itself, a number any number of
    the same exact value. (Elasticsearch compares a document without typed tokens as text:
    its own :meth:`~worker.core.ports.SearchBackend.holds_filters` says so.)

    >>> holds_filters({"year": 5.0, "lang": "en"}, {"year": 5, "lang": "en"}), holds_filters({}, {})
    (True, True)
    >>> [holds_filters({"k": v}, {"k": f}) for v, f in ((1, True), ("5", 5), (2**53 + 1, 2.0**53))]
    [False, False, False]
    >>> holds_filters({"other": 1}, {"k": 1})
    False
    """
    return all(key in metadata and _same(metadata[key], value) for key, value in filters.items())


def _holds_filters(document: StoredDocument, filters: Mapping[str, FilterValue]) -> bool:
    return holds_filters(document.metadata, filters)


def _same(held: StoredValue, wanted: FilterValue) -> bool:
    if isinstance(held, bool | str) or isinstance(wanted, bool | str):
        return type(held) is type(wanted) and held == wanted
    return held == wanted


def _document(stored: StoredDocument) -> Document:
    return Document(stored.id, stored.text, stored.title, stored.revision, stored.metadata)


def shown_digest(candidates: Sequence[Candidate]) -> str:
    """A short digest of the candidates the model is shown, in their order (ids and
    revisions: the prompt is a pure function of them, the query and the config): a kept
    answer is finished only by a run whose candidates have the same one. Hashing a few
    hundred bytes, not the prompt's text (up to tens of KB).

    >>> a, b = Document("a", "x", revision="1"), Document("b", "y", revision="1")
    >>> def shown(*docs): return shown_digest([Candidate(d, 1, 0.1, {}, {}) for d in docs])
    >>> shown(a, b) == shown(a, b), shown(a, b) == shown(b, a)
    (True, False)
    >>> shown(a, b) == shown(a, replace(b, revision="2"))
    False
    """
    text = "\n".join(f"{c.document.id}\t{c.document.revision}" for c in candidates)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def dump_prepared(prepared: Prepared) -> dict[str, Any]:
    """A prepared search as JSON-able data, for a lane that finishes it later elsewhere.

    The prompt and the trace's candidate list are not stored: :func:`load_prepared` rebuilds
    them from the candidates (the prompt is a pure function of them, the config and the cut
    its trace names, ``candidate_max_chars``). Nor are the candidates' documents whole: the
    finish reads them again as their index holds them then (:func:`as_stored`), so each
    keeps the head of its text its prompt line shows (:func:`~worker.core.policy.shown_head`)
    and no metadata. Whole, an economy item waiting at the provider held up to 200
    documents of 100,000 characters in Redis, which admission could not foresee.
    """
    chars = int(prepared.trace["candidate_max_chars"])
    return {
        "spec": prepared.spec.model_dump(mode="json"),
        "policy": prepared.policy,
        "seconds": prepared.seconds,
        "trace": {k: v for k, v in prepared.trace.items() if k != "candidates"},
        "candidates": [
            {
                "id": c.document.id,
                "text": shown_head(c.document.text, chars),
                "title": c.document.title,
                "revision": c.document.revision,
                "metadata": {},  # a worker of the release before reads it
                "rrf_rank": c.rrf_rank,
                "rrf_score": c.rrf_score,
                "channel_ranks": c.channel_ranks,
                "channel_scores": c.channel_scores,
            }
            for c in prepared.candidates
        ],
    }


def load_prepared(pipeline: SearchPipeline, data: Mapping[str, Any]) -> Prepared:
    """The inverse of :func:`dump_prepared`, with the prompt rebuilt by ``pipeline`` (of its
    release's policy), cut where the prompt first built was: the same prompt, whatever this
    worker's ``SIFT_RERANK_CANDIDATE_MAX_CHARS``. ``policy`` stays the one the search was
    prepared under: a record kept by a release before it was stored apart names it in its
    trace alone."""
    spec = SearchSpec.model_validate(data["spec"])
    candidates = [
        Candidate(
            document=Document(
                id=c["id"],
                text=c["text"],
                title=c["title"],
                revision=c["revision"],
                metadata=dict(c["metadata"]),
            ),
            rrf_rank=int(c["rrf_rank"]),
            rrf_score=float(c["rrf_score"]),
            channel_ranks=dict(c["channel_ranks"]),
            channel_scores={k: float(v) for k, v in c["channel_scores"].items()},
        )
        for c in data["candidates"]
    ]
    trace = dict(data["trace"])
    # the cut of the prompt first built, which the candidates' heads were kept for; one an
    # earlier release prepared may name none, and kept the texts whole
    chars = int(trace.get("candidate_max_chars") or pipeline.config.candidate_max_chars)
    trace["candidate_max_chars"] = chars
    prompt = pipeline.build_prompt(str(trace["query"]), spec, candidates, chars)
    if spec.include_trace:
        trace["candidates"] = _trace_candidates(candidates, prompt, chars)
    policy = str(data.get("policy") or trace.get("policy") or POLICY_ID)
    seconds = float(data["seconds"])
    return Prepared(spec, candidates, trace, prompt=prompt, seconds=seconds, policy=policy)
