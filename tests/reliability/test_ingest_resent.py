"""A write sent again after its gateway died with the request made, with the Idempotency-Key
it was first sent with: a write of the same ids accepted in between still wins.

Real processes: a redis-server, two ``sift gateway``s (one SIGKILLed while the first write's
request waits on its job, no worker running yet; the other takes the write in between and
the resend), and a ``sift worker`` started once every write is accepted; ``sift ingest`` as
its own process.

Before, ``sift ingest`` sent its request again with nothing to tie it to the first: a second
ingest job, accepted after the delete, took a newer write version than it, so the document
the delete removed was written back (the delete succeeded, ``deleted: 0``, and the document
stayed searchable). Now each request carries an ``Idempotency-Key`` of its own, and the
resend gets the first request's job back; a delete honours one the same way.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

from tests.e2e.test_ingest_interrupt import sift_ingest
from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import ACME, stack_env, wait_for
from tests.services import celery_worker, gateway, killable_gateway, redis_server
from worker.processes.stack import free_port

INDEX = "resent"


def test_an_ingest_sent_again_after_its_gateway_died_does_not_undo_a_later_delete(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": i, "text": f"quokka {i}"}) + "\n" for i in ("r1", "r2"))
    )
    with (
        FakeAnthropic() as model,
        redis_server(tmp_path / "redis") as base,
        httpx.Client(timeout=30, headers=ACME) as http,
    ):
        env = stack_env(base + "/0", model.url)
        port = free_port()
        with gateway(tmp_path / "other", env, "other") as other:

            def ingests() -> list[dict[str, str]]:
                listed = http.get(other + "/v1/ingestions").json()["ingestions"]
                return [job for job in listed if job["index"] == INDEX]

            first = ExitStack()
            _, url = first.enter_context(killable_gateway(tmp_path, env, "first", port))
            with first, sift_ingest(url, corpus, INDEX) as sift:
                wait_for(lambda: len(ingests()) == 1, "the ingest's job made")
                first.close()  # killed with the request waiting on its job: sent again
                deleted = http.delete(f"{other}/v1/indexes/{INDEX}/documents/r1")
                assert deleted.status_code == 202, deleted.text
                with (
                    killable_gateway(tmp_path, env, "second", port),
                    celery_worker(tmp_path, env, "worker"),
                ):
                    code = sift.finish(seconds=120)
                    err = sift.stderr()
                    wait_for(
                        lambda: all(job["status"] == "succeeded" for job in ingests()),
                        "every write done",
                    )
                    r1 = http.get(f"{other}/v1/indexes/{INDEX}/documents/r1")
                    r2 = http.get(f"{other}/v1/indexes/{INDEX}/documents/r2")
                    jobs = ingests()
    assert code == 0, err
    assert "trying again" in err, err  # the request was sent again
    assert r1.status_code == 404, r1.text  # the delete, accepted last, wins
    assert [job["operation"] for job in jobs] == ["delete", "upsert"], jobs  # newest first
    assert r2.json()["text"] == "quokka r2", r2.text


def test_a_delete_sent_again_with_its_key_does_not_undo_a_later_ingest(tmp_path: Path) -> None:
    """The other way round, over plain HTTP (a client or a proxy may send a ``DELETE`` again,
    idempotent by HTTP's definition): a delete whose gateway died while the request waited,
    an upsert of the id with new text accepted meanwhile, and the delete sent again with its
    ``Idempotency-Key``: the resend answers the first job, so the upsert stays the newest
    write. Before, a key on a delete was let be: the resend was a second delete job, newer
    than the upsert, and the new text was deleted."""
    keyed = {**ACME, "Idempotency-Key": "delete-x-1"}
    with (
        FakeAnthropic() as model,
        redis_server(tmp_path / "redis") as base,
        httpx.Client(timeout=60) as http,
    ):
        env = stack_env(base + "/0", model.url)
        with gateway(tmp_path / "other", env, "other") as other:
            with (
                ThreadPoolExecutor(1) as pool,  # left last: the gateway is killed first
                killable_gateway(tmp_path, env, "first") as (_, first),
            ):
                sent = pool.submit(
                    http.delete, f"{first}/v1/indexes/{INDEX}/documents/x?wait=30", headers=keyed
                )
                wait_for(lambda: len(_jobs(http, other)) == 1, "the delete's job made")
            # killed with the request waiting on its job: its answer is lost
            assert isinstance(sent.exception(), httpx.TransportError), sent
            body = {"documents": [{"id": "x", "text": "written after the delete"}]}
            upsert = http.post(f"{other}/v1/indexes/{INDEX}/documents", json=body, headers=ACME)
            assert upsert.status_code == 202, upsert.text
            again = http.delete(f"{other}/v1/indexes/{INDEX}/documents/x", headers=keyed)
            assert again.status_code in (200, 202), again.text
            with celery_worker(tmp_path, env, "worker"):
                wait_for(
                    lambda: all(j["status"] == "succeeded" for j in _jobs(http, other)),
                    "every write done",
                )
                x = http.get(f"{other}/v1/indexes/{INDEX}/documents/x", headers=ACME)
                jobs = _jobs(http, other)
    assert x.status_code == 200, x.text  # the upsert, accepted last, wins
    assert x.json()["text"] == "written after the delete"
    assert [job["operation"] for job in jobs] == ["upsert", "delete"], jobs  # newest first
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == jobs[1]["id"]


def _jobs(http: httpx.Client, gateway_url: str) -> list[dict[str, str]]:
    listed = http.get(gateway_url + "/v1/ingestions", headers=ACME).json()["ingestions"]
    return [job for job in listed if job["index"] == INDEX]
