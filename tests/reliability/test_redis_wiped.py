"""Writes accepted after Redis comes back empty still land.

Redis restarted without its persistence (``--save '' --appendonly no``: a Redis started by hand
without the AOF docs/queue.md's recipe turns on; a Redis pod without a volume; a failover to an
empty replica) loses every job, and with them the tenants' write-version counters. The backend
keeps its documents, and the version of the last write of each id, on disk. A write accepted
after the restart must still be newer than every write the backend applied before it: numbered
from a counter back at zero, an upsert of a document written before took the version it already
held and was skipped as a run of that earlier write (yet reported ``upserted: 1``), and a
delete's lower version left the document in place (``deleted: 0``, its job ``succeeded``).

Real redis-server, gateway and ``sift worker`` at their defaults; the same worker and gateway
ride out the restart.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import ACME, INDEX, stack_env, wait_for
from tests.services import celery_worker, free_port, gateway, redis_server

pytestmark = pytest.mark.integration


def write(client: httpx.Client, method: str, path: str, **kwargs: object) -> dict[str, object]:
    """One write with ``?wait=``, once Redis answers again; its finished job."""
    answers: list[httpx.Response] = []

    def sent() -> bool:
        answers.append(client.request(method, path, params={"wait": 30}, headers=ACME, **kwargs))
        return answers[-1].status_code != 503

    wait_for(sent, f"{method} {path} accepted", 60)
    response = answers[-1]
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    assert body["status"] == "succeeded", body
    return body


def document(client: httpx.Client, doc_id: str) -> httpx.Response:
    return client.get(f"/v1/indexes/{INDEX}/documents/{doc_id}", headers=ACME)


@contextlib.contextmanager
def wiping_stack(tmp_path: Path) -> Iterator[tuple[httpx.Client, Callable[[], None]]]:
    """A gateway and ``sift worker`` on a redis-server, and a function that stops that Redis
    and starts an empty one, with no persistence, on the same port under them."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(FakeAnthropic())
        first = stack.enter_context(contextlib.ExitStack())
        url = first.enter_context(redis_server(tmp_path / "redis-1", port=port))
        env = stack_env(url + "/0", model.url)
        client = stack.enter_context(
            httpx.Client(base_url=stack.enter_context(gateway(tmp_path / "g", env)), timeout=60)
        )
        stack.enter_context(celery_worker(tmp_path / "w", env, "w"))

        def wipe() -> None:
            first.close()
            stack.enter_context(redis_server(tmp_path / "redis-2", port=port))

        yield client, wipe


@pytest.mark.timeout(240)
def test_writes_after_redis_came_back_empty_are_newer_than_the_ones_before(
    tmp_path: Path,
) -> None:
    docs = f"/v1/indexes/{INDEX}/documents"
    with wiping_stack(tmp_path) as (client, wipe):
        before = [
            {"id": "kept", "text": "calcium and bone density, as first written"},
            {"id": "gone", "text": "a note on green tea to be deleted"},
        ]
        write(client, "POST", docs, json={"documents": before})

        wipe()  # Redis stopped; the same port, empty, with no persistence

        changed = {"id": "kept", "text": "calcium and bone density, as written again"}
        assert write(client, "POST", docs, json={"documents": [changed]})["upserted"] == 1
        assert document(client, "kept").json()["text"] == changed["text"]

        assert write(client, "DELETE", f"{docs}/gone")["deleted"] == 1
        assert document(client, "gone").status_code == 404
        listed = client.get(docs, headers=ACME).json()
        assert json.dumps(sorted(d["id"] for d in listed["documents"])) == '["kept"]'


@pytest.mark.timeout(240)
def test_an_indexs_own_settings_outlast_a_redis_that_came_back_empty(tmp_path: Path) -> None:
    """``PATCH`` settings lived only in Redis: back empty, the index showed the defaults and
    every search of it ran at them, with nothing said. They live with the index's data now."""
    docs = f"/v1/indexes/{INDEX}/documents"
    patch = {"fusion": {"weights": {"knn": 0.25}}, "candidate_limit": 7}
    with wiping_stack(tmp_path) as (client, wipe):
        ingested = [{"id": f"d{i}", "text": f"volcano ash note {i}"} for i in range(10)]
        write(client, "POST", docs, json={"documents": ingested})
        changed = client.patch(f"/v1/indexes/{INDEX}", json=patch, headers=ACME)
        assert changed.status_code == 200, changed.text
        settings = changed.json()["settings"]
        assert settings["candidate_limit"] == 7 and settings["fusion"]["weights"]["knn"] == 0.25

        wipe()  # Redis stopped; the same port, empty, with no persistence

        def shown() -> bool:
            answer = client.get(f"/v1/indexes/{INDEX}", headers=ACME)
            return answer.status_code != 503

        wait_for(shown, "the index read once Redis answers again", 60)
        assert client.get(f"/v1/indexes/{INDEX}", headers=ACME).json()["settings"] == settings
        search = {"index": INDEX, "query": "volcano ash", "rerank": False, "include_trace": True}
        found = write(client, "POST", "/v1/searches", json=search)
        trace = found["result"]["trace"]  # type: ignore[index]
        assert trace["candidate_limit"] == {"value": 7, "from": "index"}, trace
        assert trace["fusion"]["from"]["weights"]["knn"] == "index", trace["fusion"]
