"""Enqueueing by task name: the gateway never imports the task code, only its name and queue."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from celery import Celery

TaskMessage = tuple[str, list[Any], str]  # task name, JSON args, queue


class TaskSender(Protocol):
    """Sends task messages to the broker."""

    def send(self, name: str, args: list[Any], queue: str) -> None: ...

    def send_many(self, messages: Sequence[TaskMessage]) -> None: ...

    def close(self) -> None: ...


class CeleryTaskSender:
    """A broker-only Celery client: ``send_task`` by name, JSON, no result backend."""

    def __init__(self, broker_url: str) -> None:
        self.celery = Celery("sift-gateway", broker=broker_url, set_as_current=False)
        self.celery.conf.update(
            task_serializer="json",
            accept_content=["json"],
            result_backend=None,
            task_ignore_result=True,
            broker_connection_retry_on_startup=True,
            broker_pool_limit=64,
        )

    def send(self, name: str, args: list[Any], queue: str) -> None:
        self.celery.send_task(name, args=args, queue=queue, ignore_result=True)

    def send_many(self, messages: Sequence[TaskMessage]) -> None:
        with self.celery.producer_or_acquire() as producer:
            for name, args, queue in messages:
                self.celery.send_task(
                    name, args=args, queue=queue, producer=producer, ignore_result=True
                )

    def close(self) -> None:
        self.celery.close()


class RecordingTaskSender:
    """A fake that records messages instead of sending them (unit tests)."""

    def __init__(self) -> None:
        self.sent: list[TaskMessage] = []

    def send(self, name: str, args: list[Any], queue: str) -> None:
        self.sent.append((name, args, queue))

    def send_many(self, messages: Sequence[TaskMessage]) -> None:
        self.sent.extend(messages)

    def close(self) -> None:
        pass
