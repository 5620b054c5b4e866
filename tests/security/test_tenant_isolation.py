"""Tenant isolation as properties: no other tenant's document shows anywhere a user can see.

(a) The pipeline, many examples: random tenants holding random documents (ids shared across
    tenants, words overlapping, a per-tenant marker word in every text, the owner in the
    metadata) in the real embedded backend (SQLite FTS5 + numpy, one data directory), random
    queries (other tenants' marker words included), modes, filters (the owner field too),
    and a scripted reranker answering random positions (out of range, repeated, negative,
    not integers) or failing, under both failure policies. For each search: every hit,
    every trace candidate and every prompt sent to the model belongs to the caller, and an
    error names no other tenant's document.
(b) The stack, fewer examples: over HTTP, two tenants ingest random documents into the same
    index with the same ids; searches (rerank against the fake model, trace on), batch
    result pages, another tenant's job ids (404, the same answer as a made-up id, so
    existence does not leak), the webhook payloads (thin: type, timestamp, id, status) and
    error bodies never carry the other tenant's ids or texts.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import ACME, GLOBEX, Stack
from tests.fakes import FakeClock, FakeEmbedder, ScriptedReranker, fail, reply
from tests.services import webhook_figures, webhook_inbox
from worker.adapters.embedded import EmbeddedBackend
from worker.contract import DocumentIn, SearchResult, SearchSpec
from worker.errors import AttemptOutcome, RerankAttemptError, SiftError
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.settings import load_settings

TENANTS = ("t0", "t1", "t2", "t3")
IDS = ("a", "b", "c", "d", "e", "f")
WORDS = ("tea", "green", "river", "stone", "jazz", "delta", "ash", "chess", "bee", "salt")
LANGS = ("en", "de")


def marker(tenant: str) -> str:
    """A word only ``tenant``'s texts and titles carry."""
    return f"zq{tenant}mark"


# --- (a) the pipeline -----------------------------------------------------------------------

words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)


@st.composite
def corpora(draw: st.DrawFn) -> dict[str, list[DocumentIn]]:
    """Each tenant's documents: ids from a shared pool, overlapping words, the tenant's marker."""
    tenants = draw(st.lists(st.sampled_from(TENANTS), min_size=2, max_size=4, unique=True))
    corpus: dict[str, list[DocumentIn]] = {}
    for tenant in tenants:
        ids = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=len(IDS), unique=True))
        corpus[tenant] = [
            DocumentIn(
                id=doc_id,
                title=f"{draw(st.sampled_from(WORDS))} {marker(tenant)}",
                text=f"{draw(words)} {marker(tenant)} {draw(words)}",
                metadata={"owner": tenant, "lang": draw(st.sampled_from(LANGS))},
            )
            for doc_id in ids
        ]
    return corpus


positions = st.lists(
    st.one_of(
        st.integers(min_value=-3, max_value=40),
        st.sampled_from([0, 10**9, "1", 1.5, None, True]),
    ),
    max_size=12,
)
failures = st.sampled_from(list(AttemptOutcome)[1:])  # every failing class


@st.composite
def searches(draw: st.DrawFn, corpus: dict[str, list[DocumentIn]]) -> dict[str, Any]:
    tenant = draw(st.sampled_from(sorted(corpus)))
    others = [marker(t) for t in TENANTS if t != tenant]
    query = " ".join(draw(st.lists(st.sampled_from(WORDS + tuple(others)), min_size=1, max_size=5)))
    filters = draw(
        st.sampled_from([{}, {"lang": "en"}, {"lang": "de"}, *({"owner": t} for t in TENANTS)])
    )
    script = draw(
        st.lists(
            st.one_of(positions.map(lambda p: ("reply", p)), failures.map(lambda f: ("fail", f))),
            max_size=3,
        )
    )
    return {
        "tenant": tenant,
        "spec": SearchSpec(
            index="shared",
            query=query,
            limit=draw(st.integers(min_value=1, max_value=8)),
            mode=draw(st.sampled_from(["fts", "vector", "hybrid"])),
            rerank=draw(st.booleans()),
            include_trace=True,
            filters=filters,
        ),
        "script": script,
        "policy": draw(st.sampled_from(["fail_open", "fail_closed"])),
    }


def assert_own(tenant: str, text: str, where: str) -> None:
    for other in TENANTS:
        if other != tenant:
            assert marker(other) not in text, f"{where} carries {other}'s text"


def assert_result_is_the_tenants(tenant: str, result: SearchResult) -> None:
    for hit in result.hits:
        assert hit.metadata["owner"] == tenant, "a hit of another tenant"
        assert marker(tenant) in hit.text
        assert_own(tenant, hit.title + hit.text, "a hit")
    trace = result.trace or {}
    for candidate in trace.get("candidates", []):
        assert marker(tenant) in candidate["text"]
        assert_own(tenant, candidate["title"] + candidate["text"], "a trace candidate")
    shown = result.model_dump()
    if shown["trace"] is not None:
        shown["trace"].pop("query")  # the caller's own query, which may name other markers
    assert_own(tenant, json.dumps(shown), "the result")


counter = itertools.count()


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBackend]:
    engine = EmbeddedBackend(tmp_path_factory.mktemp("isolation") / "data")
    try:
        yield engine
    finally:
        engine.close()


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_the_pipeline_never_shows_another_tenants_document(
    backend: EmbeddedBackend, data: st.DataObject
) -> None:
    corpus = data.draw(corpora(), label="corpus")
    index = f"shared{next(counter)}"  # a fresh index per example in the one data directory
    embedder = FakeEmbedder()
    loader = Runtime(build_pipeline(load_settings(), backend=backend, embedder=embedder))
    for tenant, documents in corpus.items():
        loader.ingest(index, tenant, documents)
    for _ in range(3):
        case = data.draw(searches(corpus), label="search")
        steps = [
            reply(arg) if kind == "reply" else fail(RerankAttemptError(arg, "scripted"))
            for kind, arg in case["script"]
        ]
        reranker = ScriptedReranker(steps)
        clock = FakeClock()
        pipeline = build_pipeline(
            load_settings(
                generation_model="anthropic:claude-haiku-4-5",
                rerank_failure_policy=case["policy"],
                generation_max_requests=3,
            ),
            backend=backend,
            embedder=embedder,
            reranker=reranker,
            clock=clock,
            sleep=clock.sleep,
        )
        tenant = case["tenant"]
        spec = case["spec"].model_copy(update={"index": index})
        try:
            result = pipeline.search(spec, tenant)
        except SiftError as error:
            assert_own(tenant, str(error), "an error")
        else:
            assert_result_is_the_tenants(tenant, result)
            if spec.filters.get("owner", tenant) != tenant:
                assert result.hits == []  # filtering on another owner finds nothing
        for prompt, _ in reranker.calls:
            candidates = prompt.user.replace(spec.query.strip(), "")  # minus the caller's query
            assert_own(tenant, prompt.system + candidates, "the model's prompt")


# --- (b) the stack --------------------------------------------------------------------------

KEYS_BY_TENANT = {"acme": ACME, "globex": GLOBEX}
STACK_INDEX = "isolation"


def stack_marker(tenant: str) -> str:
    return f"qz{tenant}secretdoc"


@pytest.fixture(scope="module")
def hooks() -> Iterator[tuple[str, queue.Queue[tuple[bytes, dict[str, str]]]]]:
    with webhook_inbox() as inbox:
        yield inbox


def _without_query_echo(value: Any) -> Any:
    """``value`` without the traces' ``query``: the caller's own words, sent back."""
    if isinstance(value, dict):
        return {
            k: _without_query_echo(v)
            for k, v in value.items()
            if not (k == "query" and "coarse_limit" in value)
        }
    if isinstance(value, list):
        return [_without_query_echo(v) for v in value]
    return value


def leaked(tenant: str, text: str, foreign_ids: set[str]) -> list[str]:
    """What of the other tenant's shows in a response body: its marker, or an id only it has
    (the trace's echo of the caller's own query aside)."""
    text = json.dumps(_without_query_echo(json.loads(text)))
    other = next(t for t in KEYS_BY_TENANT if t != tenant)
    found = [stack_marker(other)] if stack_marker(other) in text else []
    return found + sorted(i for i in foreign_ids if json.dumps(i) in text)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    corpus=st.fixed_dictionaries(
        {
            tenant: st.lists(
                st.tuples(st.sampled_from((*IDS, "only-" + tenant)), words),
                min_size=1,
                max_size=5,
                unique_by=lambda pair: pair[0],
            )
            for tenant in KEYS_BY_TENANT
        }
    ),
    query=words,
    rerank=st.booleans(),
)
def test_over_http_no_tenant_sees_the_others(
    stack: Stack,
    hooks: tuple[str, queue.Queue[tuple[bytes, dict[str, str]]]],
    corpus: dict[str, list[tuple[str, str]]],
    query: str,
    rerank: bool,
) -> None:
    url, inbox = hooks
    round_ = next(counter)
    index = f"{STACK_INDEX}{round_}"  # a fresh index per example: only this round's documents
    ids = {tenant: {f"{doc_id}-{round_}" for doc_id, _ in docs} for tenant, docs in corpus.items()}
    for tenant, docs in corpus.items():
        documents = [
            {"id": f"{doc_id}-{round_}", "text": f"{text} {stack_marker(tenant)} {query}"}
            for doc_id, text in docs
        ]
        response = stack.live.post(
            f"/v1/indexes/{index}/documents",
            params={"wait": 20},
            json={"documents": documents},
            headers=KEYS_BY_TENANT[tenant],
        )
        assert response.status_code == 200 and response.json()["status"] == "succeeded"

    jobs: dict[str, dict[str, str]] = {}
    for tenant, headers in KEYS_BY_TENANT.items():
        other = next(t for t in KEYS_BY_TENANT if t != tenant)
        # only-in-the-other ids: what this tenant must never see
        foreign = ids[other] - ids[tenant]
        search = stack.live.post(
            "/v1/searches",
            params={"wait": 20},
            json={
                "index": index,
                "query": f"{query} {stack_marker(other)}",
                "rerank": rerank,
                "include_trace": True,
                "limit": 20,
                "webhook_url": url,
            },
            headers=headers,
        )
        assert search.status_code == 200, search.text
        assert search.json()["status"] == "succeeded", search.text
        assert not leaked(tenant, search.text, foreign)
        hit_ids = {hit["id"] for hit in search.json()["result"]["hits"]}
        assert hit_ids <= ids[tenant]
        batch = stack.live.post(
            "/v1/batches",
            json={
                "index": index,
                "queries": [
                    {"id": "q0", "query": query},
                    {"id": "q1", "query": stack_marker(other)},
                    {"id": "q2", "query": f"{query} {stack_marker(other)}", "mode": "fts"},
                ],
                "rerank": rerank,
                "include_trace": True,
                "webhook_url": url,
            },
            headers=headers,
        )
        assert batch.status_code == 202, batch.text
        jobs[tenant] = {"search": search.json()["id"], "batch": batch.json()["id"]}

    for tenant, headers in KEYS_BY_TENANT.items():
        other = next(t for t in KEYS_BY_TENANT if t != tenant)
        foreign = ids[other] - ids[tenant]
        batch_id = jobs[tenant]["batch"]
        for _ in range(400):
            status = stack.live.get(f"/v1/batches/{batch_id}", headers=headers).json()
            if status["status"] == "succeeded":
                break
            threading.Event().wait(0.05)
        token: str | None = None
        while True:
            page = stack.live.get(
                f"/v1/batches/{batch_id}/results",
                params={"page_size": 1, **({"page_token": token} if token else {})},
                headers=headers,
            )
            assert page.status_code == 200
            assert not leaked(tenant, page.text, foreign)
            for item in page.json()["results"]:
                for hit in (item.get("result") or {}).get("hits", []):
                    assert hit["id"] in ids[tenant]
            token = page.json()["next_page_token"]
            if token is None:
                break
        # the other tenant's jobs: 404, word for word what a made-up id gets
        for kind, path in (("search", "/v1/searches/{}"), ("batch", "/v1/batches/{}")):
            theirs = stack.live.get(path.format(jobs[other][kind]), headers=headers)
            made_up = stack.live.get(path.format("x" + jobs[other][kind][1:]), headers=headers)
            assert theirs.status_code == made_up.status_code == 404
            assert theirs.json()["error"]["type"] == made_up.json()["error"]["type"]
            assert not leaked(tenant, theirs.text, foreign)
        for path in ("/v1/batches/{}/results",):
            theirs = stack.live.get(path.format(jobs[other]["batch"]), headers=headers)
            assert theirs.status_code == 404 and not leaked(tenant, theirs.text, foreign)
        canceled = stack.live.delete(f"/v1/batches/{jobs[other]['batch']}", headers=headers)
        assert canceled.status_code == 404
        # an error body: a bad filter on this tenant's search names only what was sent
        bad = stack.live.post(
            "/v1/searches",
            json={"index": index, "query": query, "filters": {"x": [1]}},
            headers=headers,
        )
        assert bad.status_code == 422 and not leaked(tenant, bad.text, foreign)

    # the webhooks: the event type, time, and the job's own figures (those its own tenant's
    # GET answers), never another tenant's
    expected = {jobs[t][k] for t in jobs for k in jobs[t]}
    owners = {jobs[t][k]: (t, k) for t in jobs for k in jobs[t]}
    seen: set[str] = set()
    while not expected <= seen:  # earlier examples' webhooks may arrive too
        body, _ = inbox.get(timeout=30)
        event = json.loads(body)
        assert set(event) == {"type", "timestamp", "data"}
        assert all(stack_marker(t) not in body.decode() for t in KEYS_BY_TENANT)
        job_id = event["data"]["id"]
        if job_id in owners:
            tenant, kind = owners[job_id]
            path = "/v1/batches/{}" if kind == "batch" else "/v1/searches/{}"
            own = stack.live.get(path.format(job_id), headers=KEYS_BY_TENANT[tenant])
            assert event["data"] == webhook_figures(own.json())
        seen.add(job_id)


def test_made_up_and_foreign_ids_get_the_same_answer(stack: Stack) -> None:
    """Not 403 for another tenant's job: 404 exactly as for an id that never existed."""
    job = stack.live.post(
        "/v1/searches", json={"index": STACK_INDEX, "query": "tea"}, headers=GLOBEX
    ).json()
    theirs = stack.live.get(f"/v1/searches/{job['id']}", headers=ACME)
    nobody = stack.live.get("/v1/searches/srch_00000000000000000000000000000000", headers=ACME)
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json()["error"]["type"] == nobody.json()["error"]["type"] == "not_found"
    assert set(theirs.json()["error"]) == set(nobody.json()["error"])
