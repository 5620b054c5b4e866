"""The outbox's task messages are Celery's own protocol-2 messages, from a cached template."""

from __future__ import annotations

import base64
import json

from api_gateway.queue import RedisOutbox


def test_a_message_is_what_as_task_v2_and_kombu_would_write() -> None:
    outbox = RedisOutbox()
    outbox.message("sift.search", ["srch_first"], "sift.search")  # builds the template
    queue, raw = outbox.message("sift.search", ["srch_second"], "sift.search")
    envelope = json.loads(raw)
    task_id = envelope["headers"]["id"]
    headers, properties, body, _ = outbox.celery.amqp.as_task_v2(
        task_id,
        "sift.search",
        args=["srch_second"],
        kwargs={},
        ignore_result=True,
        origin=outbox.origin,
        argsrepr=repr(["srch_second"]),
        kwargsrepr="{}",
    )
    assert queue == "sift.search"
    assert envelope["headers"] == json.loads(json.dumps(headers))
    assert json.loads(base64.b64decode(envelope["body"])) == json.loads(json.dumps(body))
    assert envelope["properties"] == {
        **properties,
        "delivery_mode": 2,
        "priority": 0,
        "body_encoding": "base64",
        "delivery_info": {"exchange": "", "routing_key": "sift.search"},
        "delivery_tag": envelope["properties"]["delivery_tag"],
    }
    assert envelope["content-type"] == "application/json"


def test_each_message_has_its_own_ids_and_args() -> None:
    outbox = RedisOutbox()
    first = json.loads(outbox.message("sift.search", ["a"], "sift.search")[1])
    second = json.loads(outbox.message("sift.webhook", [{"id": "b"}], "sift.webhooks")[1])
    assert first["headers"]["id"] != second["headers"]["id"]
    assert first["properties"]["delivery_tag"] != second["properties"]["delivery_tag"]
    assert second["headers"]["task"] == "sift.webhook"
    assert second["headers"]["argsrepr"] == repr([{"id": "b"}])
    assert second["properties"]["delivery_info"]["routing_key"] == "sift.webhooks"
    assert json.loads(base64.b64decode(second["body"]))[0] == [{"id": "b"}]
