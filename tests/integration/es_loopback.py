"""A loopback HTTP server that answers like Elasticsearch 9 and records every request.

It is not a search engine: each test scripts the answers (ES 9 response shapes), and the
server records the exact requests the real ``elasticsearch`` client sent, so a test can
assert the method, path, query string and JSON or NDJSON body.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

ES_MEDIA_TYPE = "application/vnd.elasticsearch+json;compatible-with=9"


@dataclass
class Recorded:
    """One request as the server received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def ndjson(self) -> list[Any]:
        return [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]


@dataclass
class Answer:
    """What the server sends back: a status, a JSON body, and optionally a delay first."""

    status: int = 200
    body: Any = None
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


Route = Callable[[Recorded], Answer | None]
When = Callable[[Recorded], bool]


def is_probe(request: Recorded) -> bool:
    """An ``_msearch`` of the backend's channel probes (each ``terminate_after: 1``), not a
    search of the channels: both go to ``POST /<alias>/_msearch``."""
    bodies = request.ndjson()[1::2] if request.body else []
    return bool(bodies) and all("terminate_after" in body for body in bodies)


def is_search(request: Recorded) -> bool:
    return not is_probe(request)


class FakeElasticsearchServer:
    """Threaded stdlib HTTP server on 127.0.0.1; ``routes`` are tried in order, last added first.
    With ``tls`` (a server-side context) it serves HTTPS, as a secured cluster does."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[Recorded] = []
        #: Answers what no route does (a stateful stand-in); a 404 if None.
        self.fallback: Route | None = None
        self._routes: list[tuple[str, str, Route | Answer, int | None, When | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # An answer is two writes (the headers, then the body) on a kept-alive connection:
            # with Nagle's algorithm on, the body waited for the client's delayed ACK of the
            # headers, about 40 ms a request, as no Elasticsearch node makes a client wait.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                split = urlsplit(self.path)
                recorded = Recorded(
                    method=self.command,
                    path=split.path,
                    query=parse_qs(split.query),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=body,
                )
                server.requests.append(recorded)
                answer = server._answer(recorded)
                if answer.delay:
                    time.sleep(answer.delay)
                payload = b"" if answer.body is None else json.dumps(answer.body).encode()
                self.send_response(answer.status)
                self.send_header("X-Elastic-Product", "Elasticsearch")
                self.send_header("Content-Type", ES_MEDIA_TYPE)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _serve

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._scheme = "https" if tls else "http"
        if tls is not None:  # a refused handshake fails accept(), which the server shrugs off
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{self._scheme}://{host!s}:{port}"

    def start(self) -> FakeElasticsearchServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def on(
        self,
        method: str,
        path: str,
        answer: Route | Answer,
        times: int | None = None,
        when: When | None = None,
    ) -> None:
        """Answer ``method path`` with ``answer`` (``times`` times, or always; only requests
        ``when`` holds for, if given)."""
        self._routes.insert(0, (method, path, answer, times, when))

    def off(self, method: str, path: str) -> None:
        """Remove every route of ``method path``."""
        self._routes = [r for r in self._routes if (r[0], r[1]) != (method, path)]

    def _answer(self, request: Recorded) -> Answer:
        for i, (method, path, answer, times, when) in enumerate(self._routes):
            if method != request.method or path != request.path:
                continue
            if when is not None and not when(request):
                continue
            result = answer(request) if callable(answer) else answer
            if result is None:
                continue
            if times is not None:
                if times <= 1:
                    del self._routes[i]
                else:
                    self._routes[i] = (method, path, answer, times - 1, when)
            return result
        answer = self.fallback(request) if self.fallback is not None else None
        if answer is not None:
            return answer
        return Answer(404, error_body("resource_not_found_exception", f"no route {request.path}"))

    def sent(self, method: str | None = None, path: str | None = None) -> list[Recorded]:
        return [
            r
            for r in self.requests
            if (method is None or r.method == method) and (path is None or r.path == path)
        ]


def error_body(kind: str, reason: str, status: int = 400, **extra: Any) -> dict[str, Any]:
    """An ES error body: ``{"error": {"root_cause": [...], "type", "reason"}, "status"}``."""
    cause = {"type": kind, "reason": reason, **extra}
    return {"error": {"root_cause": [cause], **cause}, "status": status}


def index_missing(index: str) -> dict[str, Any]:
    return error_body(
        "index_not_found_exception",
        f"no such index [{index}]",
        status=404,
        **{"resource.type": "index_or_alias", "resource.id": index, "index": index},
    )


def search_response(hits: list[dict[str, Any]], took: int = 3) -> dict[str, Any]:
    """One search's answer as ES 9 shapes it (``track_total_hits: false``: no ``total``)."""
    return {
        "took": took,
        "timed_out": False,
        "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
        "hits": {"max_score": hits[0]["_score"] if hits else None, "hits": hits},
    }


def hit(
    index: str,
    tenant: str,
    doc_id: str,
    score: float,
    text: str = "",
    title: str = "",
    revision: str = "1",
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "_index": index,
        "_id": f"{tenant}:{doc_id}",
        "_score": score,
        "_source": {
            "doc_id": doc_id,
            "text": text or f"text of {doc_id}",
            "title": title,
            "revision": revision,
            "metadata": metadata or {},
            "tenant": tenant,
        },
    }


def msearch_response(*searches: dict[str, Any]) -> dict[str, Any]:
    return {"took": 5, "responses": [{**s, "status": s.get("status", 200)} for s in searches]}


def probe_response(matched: int, sources: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ``terminate_after: 1, track_total_hits: true`` search's answer, as ES 9 shapes it:
    the total of the documents seen before it stopped, and a hit per ``sources`` (a
    ``size: 1`` search with ``_source`` filtered: a field the document lacks is left out)."""
    hits = [
        {"_index": "sift-docs-000001", "_id": f"acme:d{n}", "_score": 0.0, "_source": source}
        for n, source in enumerate(sources or [])
    ]
    return {
        "took": 1,
        "timed_out": False,
        **({"terminated_early": True} if matched else {}),
        "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
        "hits": {
            "total": {"value": matched, "relation": "eq"},
            "max_score": 0.0 if hits else None,
            "hits": hits,
        },
    }


def probes(documents: bool, vectors: bool, model: str | None = None) -> dict[str, Any]:
    """The ``_msearch`` answer to the backend's two channel probes: does the tenant hold a
    document in the index, and one with a vector (its ``embedding_model``, if it has one)?"""
    vector_hit = [{"embedding_model": model} if model else {}] if vectors else []
    return msearch_response(
        probe_response(int(documents)), probe_response(int(vectors), vector_hit)
    )


def probes_of_a_missing_index(index: str) -> dict[str, Any]:
    """``POST /<missing>/_msearch``: ES answers 200, each search an ``index_not_found``."""
    return msearch_response(index_missing(index), index_missing(index))


# --- the index lifecycle's answers, as ES 9 shapes them ------------------------------------


def bulk_item(
    op: str, index: str, doc_id: str, status: int, result: str, **extra: Any
) -> dict[str, Any]:
    """One ``_bulk`` item: ``{"<op>": {"_index", "_id", "_version", "result", "status", ...}}``."""
    body: dict[str, Any] = {"_index": index, "_id": doc_id, "status": status, **extra}
    if result:
        body |= {
            "_version": extra.get("_version", 1),
            "result": result,
            "_shards": {"total": 2, "successful": 1, "failed": 0},
            "_seq_no": 3,
            "_primary_term": 1,
        }
    return {op: body}


def version_conflict(op: str, index: str, doc_id: str, held: int, sent: int) -> dict[str, Any]:
    """A ``_bulk`` item refused by external versioning (a newer version is held): 409."""
    reason = (
        f"[{doc_id}]: version conflict, current version [{held}] is higher or equal to the "
        f"one provided [{sent}]"
    )
    error = {"type": "version_conflict_engine_exception", "reason": reason, "index": index}
    return {op: {"_index": index, "_id": doc_id, "status": 409, "error": error}}


def bulk_response(*items: dict[str, Any]) -> dict[str, Any]:
    errors = any(next(iter(i.values()))["status"] >= 300 for i in items)
    return {"errors": errors, "took": 4, "items": list(items)}


def _by_scroll_report(took: int, total: int, **counts: int) -> dict[str, Any]:
    """The report ``_delete_by_query`` and ``_reindex`` share (a BulkByScrollResponse)."""
    return {
        "took": took,
        "timed_out": False,
        "total": total,
        **counts,
        "batches": 1,
        "noops": 0,
        "retries": {"bulk": 0, "search": 0},
        "throttled_millis": 0,
        "requests_per_second": -1.0,
        "throttled_until_millis": 0,
        "failures": [],
    }


def delete_by_query_response(deleted: int, conflicts: int = 0) -> dict[str, Any]:
    return _by_scroll_report(12, deleted + conflicts, deleted=deleted, version_conflicts=conflicts)


DELETE_BY_QUERY_ACTION = "indices:data/write/delete/byquery"


def task_info(task: str, action: str, description: str, status: Any = None) -> dict[str, Any]:
    """A task as ``GET _tasks`` lists it (``detailed``) and ``GET _tasks/<id>`` shows it."""
    node, number = task.split(":")
    return {
        "node": node,
        "id": int(number),
        "type": "transport",
        "action": action,
        **({"status": status} if status is not None else {}),
        "description": description,
        "start_time_in_millis": 1764720000000,
        "running_time_in_nanos": 1_500_000_000,
        "cancellable": True,
        "cancelled": False,
        "headers": {},
    }


def delete_by_query_task(
    task: str,
    index: str,
    *,
    completed: bool = True,
    deleted: int = 0,
    conflicts: int = 0,
    failures: list[dict[str, Any]] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``GET _tasks/<id>`` of a ``_delete_by_query`` started with
    ``wait_for_completion=false``, as ES 9 answers it: ``completed``, the task (its
    ``status``: the counts so far) and, once done, the report as ``response`` (``deleted``,
    ``version_conflicts``, ``failures``), or the ``error`` the task failed with instead."""
    report = {**delete_by_query_response(deleted, conflicts), "failures": failures or []}
    status = {k: v for k, v in report.items() if k not in ("took", "timed_out", "failures")}
    info = task_info(task, DELETE_BY_QUERY_ACTION, f"delete-by-query [{index}]", status)
    answer: dict[str, Any] = {"completed": completed, "task": info}
    if completed:
        answer |= {"error": error} if error else {"response": report}
    return answer


def tasks_list(*tasks: dict[str, Any]) -> dict[str, Any]:
    """``GET _tasks?actions=...&detailed=true``: the running tasks by node (none: ``{}``)."""
    nodes: dict[str, Any] = {}
    for info in tasks:
        node = nodes.setdefault(
            info["node"],
            {"name": "es-0", "transport_address": "10.0.0.5:9300", "host": "10.0.0.5",
             "ip": "10.0.0.5:9300", "roles": ["data", "master"], "tasks": {}},
        )  # fmt: skip
        node["tasks"][f"{info['node']}:{info['id']}"] = info
    return {"nodes": nodes}


def models_agg(*models: str) -> dict[str, Any]:
    """The ``models`` terms aggregation's answer (one bucket per model)."""
    buckets = [{"key": m, "doc_count": 1} for m in models]
    counts = {"doc_count_error_upper_bound": 0, "sum_other_doc_count": 0}
    return {"models": {**counts, "buckets": buckets}}


def terms_by_index_response(
    buckets: dict[str, int], models: dict[str, str] | None = None
) -> dict[str, Any]:
    """A ``size: 0`` search with a ``terms`` aggregation named ``indexes`` on ``_index``, each
    bucket with its ``models`` sub-aggregation (the model of ``models``, or none)."""
    models = models or {}
    return {
        "took": 2,
        "timed_out": False,
        "_shards": {"total": 2, "successful": 2, "skipped": 0, "failed": 0},
        "hits": {
            "total": {"value": sum(buckets.values()), "relation": "eq"},
            "max_score": None,
            "hits": [],
        },
        "aggregations": {
            "indexes": {
                "doc_count_error_upper_bound": 0,
                "sum_other_doc_count": 0,
                "buckets": [
                    {
                        "key": k,
                        "doc_count": n,
                        **models_agg(*([models[k]] if k in models else [])),
                    }
                    for k, n in buckets.items()
                ],
            }
        },
    }


def tenants_composite(request: Recorded, counts: dict[str, int]) -> Answer:
    """A ``size: 0`` search with a ``composite`` aggregation named ``tenants`` on the tenant
    field, as ES 9 pages it: a page of buckets with its ``after_key`` (there on the last
    full page too), then, asked ``after`` the last key, an empty page without one."""
    composite = request.json()["aggs"]["tenants"]["composite"]
    after = (composite.get("after") or {}).get("tenant")
    keys = [k for k in sorted(counts) if after is None or k > after][: composite["size"]]
    buckets = [{"key": {"tenant": k}, "doc_count": counts[k]} for k in keys]
    page: dict[str, Any] = {"buckets": buckets}
    if keys:
        page = {"after_key": {"tenant": keys[-1]}, **page}
    return Answer(
        200,
        {
            "took": 2,
            "timed_out": False,
            "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
            "hits": {"total": {"value": sum(counts.values()), "relation": "eq"}, "max_score": None,
                     "hits": []},
            "aggregations": {"tenants": page},
        },
    )  # fmt: skip


def get_found(index: str, tenant: str, doc_id: str, version: int, **source: Any) -> dict[str, Any]:
    """``GET <index>/_doc/<id>`` of a document (the vector excluded from ``_source``)."""
    return {
        "_index": index,
        "_id": f"{tenant}:{doc_id}",
        "_version": version,
        "_seq_no": 5,
        "_primary_term": 1,
        "found": True,
        "_source": {"doc_id": doc_id, "tenant": tenant, "revision": "r1", "metadata": {}, **source},
    }


def get_missing(index: str, doc_id: str) -> dict[str, Any]:
    """``GET <index>/_doc/<id>`` of no document: 404 with ``found: false``."""
    return {"_index": index, "_id": doc_id, "found": False}


def drop_counts(mine: int, others: int) -> dict[str, Any]:
    """The ``_msearch`` answer to a drop's two searches on the tenant's alias: how many of the
    tenant's documents it holds (``track_total_hits``), and whether it holds another
    tenant's (``terminate_after: 1``)."""
    return msearch_response(probe_response(mine), probe_response(others))


def aliases(*pairs: tuple[str, str]) -> dict[str, Any]:
    """``GET _alias/<name or pattern>``: ``{concrete: {"aliases": {alias: {}}}}`` per pair; a
    wildcard matching nothing answers ``{}`` with 200 (ES 7+)."""
    answer: dict[str, Any] = {}
    for concrete, alias in pairs:
        answer.setdefault(concrete, {"aliases": {}})["aliases"][alias] = {}
    return answer


def alias_missing(name: str) -> dict[str, Any]:
    """``GET _alias/<name>`` of a missing alias (no wildcard): 404 with a bare string error."""
    return {"error": f"alias [{name}] missing", "status": 404}


def require_alias_refused(op: str, alias: str, doc_id: str) -> dict[str, Any]:
    """A ``_bulk`` item refused by ``require_alias=true``: its target is no alias (gone)."""
    reason = (
        f"no such index [{alias}] and [require_alias] request flag is [true] and "
        f"[{alias}] is not an alias"
    )
    error = {"type": "index_not_found_exception", "reason": reason, "index": alias}
    return {op: {"_index": alias, "_id": doc_id, "status": 404, "error": error}}


def reindex_response(created: int, updated: int = 0, conflicts: int = 0) -> dict[str, Any]:
    """``POST _reindex?wait_for_completion=true``'s report."""
    total = created + updated + conflicts
    return _by_scroll_report(
        40, total, updated=updated, created=created, deleted=0, version_conflicts=conflicts
    )


def floor_found(index: str, alias: str, version: int) -> dict[str, Any]:
    """``GET <floors>/_doc/<alias>`` of a drop floor: an empty document, its external version
    the drop's."""
    return {
        "_index": index,
        "_id": alias,
        "_version": version,
        "_seq_no": 0,
        "_primary_term": 1,
        "found": True,
        "_source": {},
    }


def floor_written(index: str, alias: str, version: int) -> dict[str, Any]:
    """``PUT <floors>/_doc/<alias>?version=<v>&version_type=external``: 201 created."""
    return {
        "_index": index,
        "_id": alias,
        "_version": version,
        "result": "created",
        "_shards": {"total": 2, "successful": 1, "failed": 0},
        "_seq_no": 1,
        "_primary_term": 1,
    }


def running(server: FakeElasticsearchServer) -> Iterator[FakeElasticsearchServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


def resolved(*indexes: tuple[str, list[str]]) -> dict[str, Any]:
    """``GET _resolve/index/<pattern>``: each matching concrete index with its aliases (a
    wildcard matching nothing answers empty lists with 200)."""
    by_alias: dict[str, list[str]] = {}
    for name, held in indexes:
        for alias in held:
            by_alias.setdefault(alias, []).append(name)
    return {
        "indices": [
            {"name": name, "aliases": held, "attributes": ["open"]} for name, held in indexes
        ],
        "aliases": [{"name": a, "indices": sorted(n)} for a, n in sorted(by_alias.items())],
        "data_streams": [],
    }


# --- TLS: a private CA, as ECK and Elasticsearch 9's own security setup make ---------------


@dataclass(frozen=True)
class PrivateCa:
    """A CA and a node certificate it signed (for 127.0.0.1), made by ``openssl``."""

    ca: Path  # the CA's certificate (PEM): what a client trusts
    node: Path  # the node's certificate
    chain: Path  # the node's certificate, then the CA's: what the server sends
    key: Path  # the node's private key

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.chain, self.key)
        return context

    def fingerprint(self, which: str = "node") -> str:
        """The SHA-256 fingerprint of the node's (or the CA's) certificate, as
        ``openssl x509 -fingerprint -sha256`` prints it (colon-separated, upper case)."""
        pem = (self.node if which == "node" else self.ca).read_text()
        digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest().upper()
        return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def private_ca(directory: Path) -> PrivateCa:
    """Make a CA and a node certificate for 127.0.0.1 in ``directory`` with ``openssl``."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2".split()
    ca_extensions = "basicConstraints=critical,CA:TRUE", "keyUsage=critical,keyCertSign,cRLSign"
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=Sift test CA",
            "-addext", ca_extensions[0], "-addext", ca_extensions[1])  # fmt: skip
    openssl("req", *ec[:-2], "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=localhost")
    (directory / "node.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    openssl(*"x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial".split(),
            *"-out node.pem -days 2 -extfile node.ext".split())  # fmt: skip
    chain = directory / "chain.pem"
    chain.write_text((directory / "node.pem").read_text() + (directory / "ca.pem").read_text())
    return PrivateCa(
        ca=directory / "ca.pem",
        node=directory / "node.pem",
        chain=chain,
        key=directory / "node.key",
    )
