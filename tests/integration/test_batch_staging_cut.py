"""A batch's staging cut short on the wire (the gateway killed, the connection broken while
its pipeline of slices is on its way to Redis): whatever part reached Redis expires.

The client reaches redis-server through :class:`CutAfter`, a TCP proxy that forwards the
first ``limit`` bytes a connection sends and then ends it: the client's side closed, Redis's
side half-closed, so Redis runs every whole command up to the cut and drops the rest, as it
does when a gateway dies mid-pipeline (audit 5, F2: the slices applied, the ``EXPIRE``\\ s
after them never sent, three keys of megabytes kept for good).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.services import free_port
from worker.constants import (
    BATCH_ITEMS_KEY,
    BATCH_ORDER_KEY,
    BATCH_SPECS_KEY,
    BATCH_STAGE_SLICE,
    BATCH_STAGING_TTL_SECONDS,
)
from worker.contract import SearchSpec
from worker.queue.jobstore import JobStore

pytestmark = pytest.mark.integration

BATCH = "bat_cut"
KEYS = [key + BATCH for key in (BATCH_ORDER_KEY, BATCH_SPECS_KEY, BATCH_ITEMS_KEY)]
# five slices and a few items, each spec as the gateway sends it (its JSON)
ITEMS = [
    (f"q{i}", SearchSpec(index="docs", query=f"bees and honey {i}").model_dump_json())
    for i in range(5 * BATCH_STAGE_SLICE + 7)
]


class CutAfter:
    """The proxy (see the module doc): ``limit`` None forwards everything; ``cuts`` is how
    many connections are cut before the rest pass whole. ``sent`` counts the bytes the
    clients sent up; ``upstream`` lists the proxy's own addresses towards Redis, to tell
    when Redis is done with each (``host:port``, as ``CLIENT LIST`` shows them)."""

    def __init__(self, redis_port: int, limit: int | None, *, cuts: int = 1) -> None:
        self.port = free_port()
        self.limit, self.cuts = limit, cuts
        self.sent = 0
        self.upstream: list[str] = []
        self._target = redis_port
        self._server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._server.accept()
                upstream = socket.create_connection(("127.0.0.1", self._target))
                host, port = upstream.getsockname()[:2]
                self.upstream.append(f"{host}:{port}")
                limit = self.limit if self.cuts > 0 else None
                self.cuts -= 1
                threading.Thread(
                    target=self._up, args=(client, upstream, limit), daemon=True
                ).start()
                threading.Thread(target=self._down, args=(client, upstream), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, limit: int | None) -> None:
        """Client to Redis until ``limit`` bytes; then Redis gets an end of file after the
        last byte, and the client a closed connection."""
        passed = 0
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if limit is not None:
                    data = data[: limit - passed]
                upstream.sendall(data)
                passed += len(data)
                self.sent += len(data)
                if limit is not None and passed >= limit:
                    break
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)
        client.close()

    def _down(self, client: socket.socket, upstream: socket.socket) -> None:
        """Redis to client, read to Redis's own close (a reply the client can no longer
        take is dropped), so Redis sees an orderly end, never a reset."""
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                with contextlib.suppress(OSError):
                    client.sendall(data)
        upstream.close()


@pytest.fixture
def direct(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


def _stage_through(proxy: CutAfter, db: int, retries: int) -> None:
    """Stage the batch through ``proxy`` with a client making ``retries`` retries."""
    client = redis.Redis(
        port=proxy.port,
        db=db,
        decode_responses=True,
        retry=Retry(NoBackoff(), retries),
        socket_timeout=30,
    )
    try:
        JobStore(client)._stage_items(BATCH, ITEMS)
    finally:
        client.close()


def _done_with(direct: redis.Redis, proxy: CutAfter) -> None:
    """Wait until Redis has closed every connection of the proxy: everything that reached
    it has run."""
    for _ in range(3000):
        open_ = {entry["addr"] for entry in direct.client_list()}
        if not open_ & set(proxy.upstream):
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"Redis kept the proxy's connections {proxy.upstream}")


def _where(direct: redis.Redis) -> tuple[int, int]:
    """The port and database of the module's redis-server."""
    kwargs = direct.connection_pool.connection_kwargs
    return int(kwargs["port"]), int(kwargs["db"])


def _full_length(redis_port: int, db: int, direct: redis.Redis) -> int:
    """The bytes the whole staging sends (connection handshake included)."""
    proxy = CutAfter(redis_port, None)
    try:
        _stage_through(proxy, db, retries=0)
    finally:
        proxy.close()
    _done_with(direct, proxy)
    assert direct.llen(KEYS[0]) == len(ITEMS)
    direct.delete(*KEYS)
    return proxy.sent


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95])
def test_a_staging_cut_short_leaves_no_key_without_its_ttl(
    direct: redis.Redis, fraction: float
) -> None:
    """The staging's connection cut after ``fraction`` of its bytes, no retry (the gateway
    died): the keys that exist each carry the staging TTL, and hold whole slices only."""
    port, db = _where(direct)
    limit = int(fraction * _full_length(port, db, direct))
    proxy = CutAfter(port, limit)
    try:
        with pytest.raises(redis.ConnectionError):
            _stage_through(proxy, db, retries=0)
    finally:
        proxy.close()
    _done_with(direct, proxy)
    staged = [key for key in KEYS if direct.exists(key)]
    if fraction >= 0.5:  # the cut came after whole slices: they are there
        assert staged == KEYS
    for key in staged:
        assert 0 < direct.ttl(key) <= BATCH_STAGING_TTL_SECONDS, (key, direct.ttl(key))
    applied = direct.llen(KEYS[0])
    assert applied % BATCH_STAGE_SLICE == 0
    assert direct.hlen(KEYS[1]) == direct.hlen(KEYS[2]) == applied
    assert direct.lrange(KEYS[0], 0, -1) == [qid for qid, _ in ITEMS[:applied]]


@pytest.mark.parametrize("fraction", [0.2, 0.8])
def test_a_staging_sent_again_after_a_cut_pushes_the_order_once(
    direct: redis.Redis, fraction: float
) -> None:
    """The first connection cut after ``fraction`` of the bytes, redis-py sends the pipeline
    again on a new one: every item once, in order, all three keys with the staging TTL."""
    port, db = _where(direct)
    limit = int(fraction * _full_length(port, db, direct))
    proxy = CutAfter(port, limit, cuts=1)
    try:
        _stage_through(proxy, db, retries=1)
    finally:
        proxy.close()
    assert len(proxy.upstream) == 2  # it was sent again
    assert direct.lrange(KEYS[0], 0, -1) == [qid for qid, _ in ITEMS]
    assert direct.hlen(KEYS[1]) == direct.hlen(KEYS[2]) == len(ITEMS)
    for key in KEYS:
        assert 0 < direct.ttl(key) <= BATCH_STAGING_TTL_SECONDS


def test_a_command_failing_inside_a_slice_s_exec_raises(
    direct: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slice's ``EXEC`` answers a run-time error (a WRONGTYPE) as an element of its reply,
    which a plain pipeline does not raise: the staging raises it. Made here by staging the
    statuses into the order list's own key (the layout monkeypatched), so the slice's
    ``HSET`` meets a list. Before, the staging returned as if every item were written."""
    from worker.queue.jobstore import batches

    monkeypatch.setattr(batches, "_staged_keys", lambda bid: (KEYS[0], KEYS[1], KEYS[0]))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        JobStore(direct)._stage_items(BATCH, ITEMS)
