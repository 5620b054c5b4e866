"""The re-drive's pure parts: which job a broker message covers, and positions as chunks."""

from __future__ import annotations

import json

from api_gateway.queue import RedisOutbox
from worker.constants import BATCH_CHUNK_TASK, BATCH_QUEUE, SEARCH_QUEUE, SEARCH_TASK, WEBHOOK_TASK
from worker.queue.redrive import Coverage, coverage, runs


def envelope(name: str, args: list[object], queue: str) -> dict[str, object]:
    _, raw = RedisOutbox().message(name, args, queue)
    parsed: dict[str, object] = json.loads(raw)
    return parsed


def test_a_message_covers_its_search_or_its_chunk() -> None:
    assert coverage(envelope(SEARCH_TASK, ["srch_1"], SEARCH_QUEUE)) == Coverage(
        "srch_1", range(0, 1)
    )
    assert coverage(envelope(BATCH_CHUNK_TASK, ["bat_1", 20, 30], BATCH_QUEUE)) == Coverage(
        "bat_1", range(20, 30)
    )


def test_other_messages_cover_nothing() -> None:
    assert coverage(envelope(WEBHOOK_TASK, [{"data": {"id": "srch_1"}}], "sift.webhooks")) is None
    assert coverage({"headers": {"task": SEARCH_TASK}, "body": "not base64 JSON"}) is None
    assert coverage({"body": "e30="}) is None


def test_runs_split_positions_into_chunks() -> None:
    assert runs([]) == []
    assert runs([7, 1, 2, 3, 3]) == [(1, 4), (7, 8)]
    assert runs(range(0, 25), 10) == [(0, 10), (10, 20), (20, 25)]
    assert runs([1, 2, 3, 7], 2) == [(1, 3), (3, 4), (7, 8)]
