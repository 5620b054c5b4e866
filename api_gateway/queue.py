"""Enqueueing by task name: the gateway never imports the task code, only its name and queue."""

from __future__ import annotations

import base64
import json
import socket
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery

from worker.queue.jobstore import JobStore

TaskMessage = tuple[str, list[Any], str]  # task name, JSON args, queue


class RedisOutbox:
    """Builds Celery task messages for the Redis broker, to LPUSH in the job store's transaction.

    The job record and its task message are then written in one transaction: the gateway
    can never leave a record without its message (or a message without its record), and a
    submission costs one Redis round trip. Headers and body come from Celery's own
    ``as_task_v2`` (protocol 2); the envelope is what kombu's Redis transport writes.

    ``as_task_v2`` costs about 0.1 ms, so it runs once per task name: a message copies that
    template and sets what differs per message (the ``id``, ``root_id`` and ``argsrepr``
    headers, the correlation id, the delivery tag and the body).
    """

    def __init__(self) -> None:
        self.celery = Celery("sift-gateway", set_as_current=False)
        self.origin = f"gateway@{socket.gethostname()}"
        self._templates: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}

    def _template(self, name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(headers, properties, embed) of ``name``'s messages, from Celery itself."""
        template = self._templates.get(name)
        if template is None:
            headers, properties, body, _ = self.celery.amqp.as_task_v2(
                "", name, args=[], kwargs={}, ignore_result=True, origin=self.origin,
                argsrepr="[]", kwargsrepr="{}",
            )  # fmt: skip
            template = self._templates[name] = (dict(headers), dict(properties), body[2])
        return template

    def message(
        self, name: str, args: list[Any], queue: str, countdown: float | None = None
    ) -> tuple[str, str]:
        """(list key, raw message) for one task; due ``countdown`` seconds from now if given
        (Celery's ``eta`` header: the worker that takes it holds it until then)."""
        task_id = str(uuid.uuid4())
        headers, properties, embed = self._template(name)
        if countdown is not None:
            headers = {
                **headers,
                "eta": (datetime.now(UTC) + timedelta(seconds=countdown)).isoformat(),
            }
        raw_body = json.dumps([args, {}, embed], separators=(",", ":")).encode()
        envelope = {
            "body": base64.b64encode(raw_body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {**headers, "id": task_id, "root_id": task_id, "argsrepr": repr(args)},
            "properties": {
                **properties,
                "correlation_id": task_id,
                "delivery_mode": 2,
                "priority": 0,
                "body_encoding": "base64",
                "delivery_info": {"exchange": "", "routing_key": queue},
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        return queue, json.dumps(envelope, separators=(",", ":"))


class OutboxSender:
    """The gateway's default sender: messages go to Redis through the job store, atomically
    with the job record when :meth:`messages` is handed to a ``create_*`` call."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.outbox = RedisOutbox()

    def messages(self, batch: Sequence[TaskMessage]) -> list[tuple[str, str]]:
        return [self.outbox.message(name, args, queue) for name, args, queue in batch]

    def due(self, name: str, args: list[Any], queue: str) -> Callable[[float], tuple[str, str]]:
        """The message of one task, due in the seconds the caller gives it."""
        return lambda seconds: self.outbox.message(name, args, queue, countdown=seconds)

    def send(self, name: str, args: list[Any], queue: str) -> None:
        self.store.push_messages(self.messages([(name, args, queue)]))

    def send_next(self, name: str, args: list[Any], queue: str) -> None:
        """Send one task ahead of every message waiting in its queue: the next a worker
        takes from it (an index read, which its caller waits for)."""
        self.store.push_messages(self.messages([(name, args, queue)]), next_taken=True)

    def send_many(self, messages: Sequence[TaskMessage]) -> None:
        self.store.push_messages(self.messages(messages))

    def close(self) -> None:
        pass
