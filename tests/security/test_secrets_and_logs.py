"""Secrets and logs: keys held as digests and compared in constant time, webhook secret
rotation with two signatures, and no key, secret or document text in any log of a full run.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from starlette.testclient import TestClient

from api_gateway.app import create_app
from api_gateway.auth import KeyRing
from tests.e2e.conftest import ACME, ANTHROPIC_API_KEY, GLOBEX, KEYS, Stack
from tests.fake_anthropic import FakeAnthropic, status
from tests.fakes import FakeEmbedder
from tests.security.conftest import GLOBEX_PREVIOUS_SECRET, SECURITY_KEYS, Receiver
from worker.contract import DocumentIn, SearchSpec
from worker.errors import RerankFailed
from worker.observability.logcontext import WIRE_LOGGERS, configure_logging
from worker.runtime.inprocess import build_runtime
from worker.settings import ApiKey, Settings, load_settings
from worker.webhooks.delivery import SEARCH_COMPLETED, deliver, message_id, payload

# --- keys -----------------------------------------------------------------------------------


def _strings_in(value: Any, seen: set[int] | None = None) -> Iterator[str | bytes]:
    """Every str and bytes reachable from ``value`` (attributes, containers)."""
    seen = seen if seen is not None else set()
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, str | bytes):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings_in(k, seen)
            yield from _strings_in(v, seen)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from _strings_in(item, seen)
    elif hasattr(value, "__dict__"):
        yield from _strings_in(vars(value), seen)


def test_the_gateway_holds_only_digests_of_the_keys() -> None:
    app = create_app(Settings(api_keys=[ApiKey(**k) for k in KEYS]))
    ring: KeyRing = app.state.keyring
    held = list(_strings_in(ring))
    for entry in KEYS:
        raw = entry["key"]
        assert all(raw not in s for s in held if isinstance(s, str))
        assert all(raw.encode() not in s for s in held if isinstance(s, bytes))
        assert hashlib.sha256(raw.encode()).digest() in held  # what it holds instead
    assert ring.tenant_for(KEYS[0]["key"]) == "acme"
    assert ring.tenant_for(KEYS[0]["key"] + "x") is None


@pytest.mark.parametrize("presented", ["acme-key-0001", "globex-key-0001", "nobody-key-0001", ""])
def test_every_key_is_compared_with_compare_digest_and_none_is_skipped(
    monkeypatch: pytest.MonkeyPatch, presented: str
) -> None:
    """hmac.compare_digest, once per known key whatever matches: no early exit, no ``==``."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = [ApiKey(**k) for k in KEYS] + [
        ApiKey(key="third-key-0001", tenant="initech", webhook_secret=KEYS[0]["webhook_secret"])
    ]
    ring = KeyRing(keys)
    ring.tenant_for(presented)
    assert len(calls) == len(keys)
    digest = hashlib.sha256(presented.encode()).digest()
    assert all(b == digest and len(a) == 32 for a, b in calls)  # digests, never the raw key


def test_the_gateway_authenticates_through_the_keyring(stack: Stack) -> None:
    assert stack.idle.get("/v1/searches/srch_x", headers=ACME).status_code == 404
    wrong = stack.idle.get("/v1/searches/srch_x", headers={"Authorization": "Bearer acme-key-0002"})
    assert wrong.status_code == 403
    assert "acme-key-0002" not in wrong.text  # the refusal does not echo the key
    assert stack.idle.get("/v1/searches/srch_x").status_code == 401


# --- webhook secret rotation ----------------------------------------------------------------


def test_during_a_rotation_the_worker_sends_two_signatures_each_verifying(
    stack: Stack, receiver: Receiver, wait_for: Callable[..., None]
) -> None:
    """globex is mid-rotation on the stack (webhook_secret_previous set): its webhooks carry a
    signature per secret, and a receiver holding either one verifies them. acme is not."""
    for headers in (GLOBEX, ACME):
        stack.live.post(
            "/v1/searches",
            params={"wait": 20},
            json={"index": "rotation", "query": "tea", "webhook_url": receiver.url},
            headers=headers,
        )
    wait_for(lambda: len(receiver.requests) >= 2, "both webhooks")
    by_secret_count = {len(r.headers["webhook-signature"].split()): r for r in receiver.requests}
    rotating, single = by_secret_count[2], by_secret_count[1]
    current, previous = SECURITY_KEYS[1]["webhook_secret"], GLOBEX_PREVIOUS_SECRET
    for secret in (current, previous):
        event = Webhook(secret).verify(rotating.body, rotating.headers)
        assert event["type"] == "search.completed"
    with pytest.raises(WebhookVerificationError):
        Webhook(KEYS[0]["webhook_secret"]).verify(rotating.body, rotating.headers)
    Webhook(KEYS[0]["webhook_secret"]).verify(single.body, single.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(previous).verify(single.body, single.headers)


def test_after_the_rotation_only_the_new_secret_verifies(receiver: Receiver) -> None:
    """Step two of the procedure: webhook_secret_previous dropped, one signature again."""
    done = ApiKey(key="globex-key-0001", tenant="globex", webhook_secret=KEYS[1]["webhook_secret"])
    body = payload(SEARCH_COMPLETED, "srch_after", "succeeded")
    deliver(
        receiver.url, body, message_id("srch_after"), done.webhook_secrets(), allow_private=True
    )
    [got] = receiver.requests
    assert len(got.headers["webhook-signature"].split()) == 1
    Webhook(KEYS[1]["webhook_secret"]).verify(got.body, got.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(GLOBEX_PREVIOUS_SECRET).verify(got.body, got.headers)


# --- logs -----------------------------------------------------------------------------------

MARKERS = [f"zzlogmarker{n}qq" for n in range(6)]  # one distinctive word per document


def forbidden() -> dict[str, str]:
    """Everything that must never be logged, by what it is."""
    found: dict[str, str] = {"ANTHROPIC_API_KEY": ANTHROPIC_API_KEY}
    for key in SECURITY_KEYS:
        found[f"API key of {key['tenant']}"] = key["key"]
        for name in ("webhook_secret", "webhook_secret_previous"):
            if name in key:
                secret = key[name]
                found[f"{name} of {key['tenant']}"] = secret
                found[f"{name} of {key['tenant']}, its payload"] = secret.removeprefix("whsec_")
                raw = base64.b64decode(secret.removeprefix("whsec_"))
                found[f"{name} of {key['tenant']}, its bytes"] = raw.decode("latin-1")
    for marker in MARKERS:
        found[f"document text {marker}"] = marker
    return found


def offences(text: str) -> list[str]:
    return [what for what, value in forbidden().items() if value and value in text]


@pytest.fixture
def quiet_wire_levels() -> Iterator[None]:
    """Put back the wire loggers' levels that configure_logging raised."""
    before = {name: logging.getLogger(name).level for name in WIRE_LOGGERS}
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for name, lvl in before.items():
            logging.getLogger(name).setLevel(lvl)
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)


def test_no_log_of_a_full_run_holds_a_key_a_secret_or_a_document_text(
    stack: Stack,
    receiver: Receiver,
    wait_for: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
    quiet_wire_levels: None,
    tmp_path: Any,
) -> None:
    """A full run through the stack, every process at DEBUG, plus the same paths in this
    process under caplog at DEBUG; then every log line is searched for every secret."""
    caplog.set_level(logging.DEBUG)
    configure_logging("DEBUG", logging.getLogger("sift-log-test"))  # as a process would

    # --- through the stack's processes ---
    documents = [
        {"id": f"d{n}", "title": f"title {marker}", "text": f"green tea {marker} leaves"}
        for n, marker in enumerate(MARKERS)
    ]
    for headers in (ACME, GLOBEX):
        ingest = stack.live.post(
            "/v1/indexes/logs/documents",
            params={"wait": 20},
            json={"documents": documents},
            headers=headers,
        )
        assert ingest.json()["status"] == "succeeded", ingest.text
    reranked = stack.live.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": "logs", "query": "green tea", "rerank": True, "include_trace": True,
              "webhook_url": receiver.url},
        headers=GLOBEX,
    )  # fmt: skip
    assert reranked.json()["result"]["rerank"]["applied"] is True, reranked.text
    assert any(m in reranked.text for m in MARKERS)  # the text is there, just not in logs
    batch = stack.live.post(
        "/v1/batches",
        json={"index": "logs", "webhook_url": receiver.url, "rerank": True,
              "queries": [{"id": str(i), "query": f"tea {m}"} for i, m in enumerate(MARKERS)]},
        headers=ACME,
    ).json()  # fmt: skip
    wait_for(lambda: len(receiver.requests) >= 2, "the search and batch webhooks")
    status_now = stack.live.get(f"/v1/batches/{batch['id']}", headers=ACME).json()
    assert status_now["status"] == "succeeded"
    stack.model.script([status(400, message="bad request")])  # http_4xx: permanent
    failing = stack.live.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": "logs", "query": "leaves", "rerank": True},
        headers=ACME,
    )
    assert failing.json()["status"] == "failed", failing.text
    refused = [
        stack.live.post(
            "/v1/searches",
            json={"index": "logs", "query": MARKERS[0] * 200},
            headers=ACME,
        ),
        stack.live.get(
            "/v1/searches/x", headers={"Authorization": "Bearer " + KEYS[0]["key"] + "z"}
        ),
        stack.idle.post(
            "/v1/searches",
            json={"index": "logs", "query": MARKERS[1], "webhook_url": "http://10.0.0.1/"},
            headers=GLOBEX,
        ),
    ]
    assert [r.status_code for r in refused] == [422, 403, 422]

    # --- the same paths in this process ---
    settings = load_settings(
        generation_model="anthropic:claude-haiku-4-5", data_dir=tmp_path / "data"
    )
    with FakeAnthropic() as model:
        runtime_env = pytest.MonkeyPatch()
        runtime_env.setenv("ANTHROPIC_BASE_URL", model.url)
        runtime_env.setenv("ANTHROPIC_API_KEY", ANTHROPIC_API_KEY)
        try:
            runtime = build_runtime(settings, embedder=FakeEmbedder())
            runtime.ingest(
                "logs",
                "acme",
                [DocumentIn(**{k: d[k] for k in ("id", "title", "text")}) for d in documents],
            )
            result = runtime.search(
                SearchSpec(index="logs", query="green tea", rerank=True), "acme"
            )
            assert result.rerank.applied
            model.script([status(400)])
            with pytest.raises(RerankFailed):
                runtime.search(SearchSpec(index="logs", query="leaves", rerank=True), "acme")
        finally:
            runtime_env.undo()
    rotating = [SECURITY_KEYS[1]["webhook_secret"], GLOBEX_PREVIOUS_SECRET]
    body = payload(SEARCH_COMPLETED, "srch_inproc", "succeeded")
    deliver(receiver.url, body, message_id("srch_inproc"), rotating, allow_private=True)
    with TestClient(
        create_app(
            Settings(
                redis_url=stack.redis_url + "/4", api_keys=[ApiKey(**k) for k in SECURITY_KEYS]
            )
        )
    ) as client:
        client.post("/v1/searches", json={"index": "logs", "query": MARKERS[2]}, headers=ACME)
        client.post("/v1/searches", json={"index": "logs", "query": MARKERS[2] * 500}, headers=ACME)
        client.get("/v1/searches/x", headers={"Authorization": "Bearer " + KEYS[1]["key"] + "!"})

    # --- every log, searched ---
    logs = {str(path): path.read_text(errors="replace") for path in stack.logs}
    assert all(logs.values()), "a process wrote no log"
    assert "DEBUG" in logs[str(stack.logs[0])]  # the worker did log at DEBUG
    assert "webhook msg_" in logs[str(stack.logs[0])]  # and it logged the deliveries
    logs["caplog (this process)"] = "\n".join(
        f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records
    )
    # the capture is live: the in-process index and webhook delivery logged through it
    assert {"worker.adapters.embedded", "worker.webhooks.delivery"} <= {
        r.name for r in caplog.records
    }
    found = {where: offences(text) for where, text in logs.items()}
    assert found == {where: [] for where in logs}
