"""The Celery settings Sift relies on for reliable delivery."""

from __future__ import annotations

import pytest

from worker.constants import ALL_QUEUES, BATCH_CHUNK_TASK, SEARCH_TASK, TASK_NAMES, WEBHOOK_TASK
from worker.errors import ConfigError
from worker.queue.celery_app import create_celery_app
from worker.queue.config import (
    TASK_ROUTES,
    celery_config,
    ingest_redelivery_window,
    time_limits,
    warn_if_tombstones_too_short,
)
from worker.redis_client import OUTAGE_SECONDS
from worker.settings import load_settings


def test_reliable_delivery_settings() -> None:
    settings = load_settings(redis_url="redis://127.0.0.1:1/0", search_deadline_seconds=20)
    conf = celery_config(settings)
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["worker_prefetch_multiplier"] == 1
    # only prefork can kill a job; the threads pool would raise NotImplementedError mid-reconnect
    assert not conf["worker_cancel_long_running_tasks_on_connection_loss"]
    prefork = celery_config(load_settings(redis_url="redis://127.0.0.1:1/0", worker_pool="prefork"))
    assert prefork["worker_cancel_long_running_tasks_on_connection_loss"]
    assert conf["worker_soft_shutdown_timeout"] > 0
    assert conf["accept_content"] == ["json"] and conf["task_serializer"] == "json"
    longest_hard = max(hard for _, hard in time_limits(settings).values())
    assert conf["broker_transport_options"]["visibility_timeout"] > longest_hard
    soft, hard = time_limits(settings)[SEARCH_TASK]
    assert 20 < soft < hard
    assert conf["worker_pool"] == "threads"


def test_a_short_visibility_timeout_is_swept_often() -> None:
    settings = load_settings(redis_url="redis://127.0.0.1:1/0", broker_visibility_timeout_seconds=6)
    options = celery_config(settings)["broker_transport_options"]
    assert options["visibility_timeout"] == 6
    assert options["unacked_restore_interval"] == 1 and options["unacked_restore_throttle"] == 1
    assert options["unacked_mutex_expire"] == 6


def test_each_queue_has_its_own_exchange_and_key() -> None:
    conf = celery_config(load_settings(redis_url="redis://127.0.0.1:1/0"))
    queues = {q.name: q for q in conf["task_queues"]}
    assert set(queues) == set(ALL_QUEUES)
    for name, q in queues.items():
        assert q.exchange.name == name and q.routing_key == name


def test_tasks_are_registered_by_name() -> None:
    app = create_celery_app(load_settings(redis_url="redis://127.0.0.1:1/0"))
    for name in (SEARCH_TASK, BATCH_CHUNK_TASK, WEBHOOK_TASK):
        assert name in app.tasks
        assert app.tasks[name].acks_late
    # every routed task, the economy lane's too: the app registers them (the tasks import
    # nothing of it)
    assert set(TASK_ROUTES) <= set(app.tasks)


def test_every_task_is_one_a_worker_makes_its_task_series_for() -> None:
    """A worker makes sift_task_retries_total at zero for TASK_NAMES when it starts: a task
    left out would show no increase() at its first retry."""
    app = create_celery_app(load_settings(redis_url="redis://127.0.0.1:1/0"))
    assert set(TASK_NAMES) == {name for name in app.tasks if name.startswith("sift.")}


def test_a_heartbeat_must_be_missed_several_times_before_a_worker_is_dead() -> None:
    with pytest.raises(ConfigError, match="SIFT_WORKER_DEAD_AFTER_SECONDS"):
        load_settings(worker_heartbeat_seconds=5, worker_dead_after_seconds=10)
    settings = load_settings()
    assert settings.worker_dead_after_seconds >= 3 * settings.worker_heartbeat_seconds


def test_every_task_releases_its_delivery_record_on_ack() -> None:
    from celery.worker.request import Request

    from worker.queue.base import SiftTask
    from worker.queue.liveness import OwnedRequest

    assert SiftTask.Request == "worker.queue.liveness:OwnedRequest"
    assert issubclass(OwnedRequest, Request)
    assert OwnedRequest.acknowledge is not Request.acknowledge
    assert OwnedRequest.reject is not Request.reject


def test_the_tombstones_outlast_an_ingests_redelivery_at_the_defaults() -> None:
    """Either backend keeps a delete's tombstone SIFT_ELASTICSEARCH_GC_DELETES_SECONDS: at
    the defaults that outlasts the longest an ingest accepted before the delete can still
    run; raising the delivery limit past it (or shortening the tombstones) is warned about,
    on the embedded backend too, which kept its tombstones for good before."""
    settings = load_settings(redis_url="redis://localhost", search_backend="elasticsearch")
    window = ingest_redelivery_window(settings)
    assert window > 60  # Elasticsearch's own default would not do
    assert settings.elasticsearch_gc_deletes_seconds >= window
    assert not warn_if_tombstones_too_short(settings)
    more = load_settings(
        redis_url="redis://localhost", search_backend="elasticsearch", task_max_deliveries=10
    )
    assert warn_if_tombstones_too_short(more)
    assert not warn_if_tombstones_too_short(load_settings(redis_url="redis://localhost"))
    embedded = load_settings(redis_url="redis://localhost", task_max_deliveries=10)
    assert warn_if_tombstones_too_short(embedded)


def test_the_redelivery_window_counts_every_retrys_own_deliveries() -> None:
    """A retry is a new message with its own delivery budget (the counter is kept per task id
    *and* retry number, ``JobStore.count_delivery``), so an ingest can be taken
    SIFT_TASK_MAX_DELIVERIES times for each of its 1 + SIFT_TASK_MAX_RETRIES messages, each
    take given back no sooner than the visibility timeout: the window, and at the defaults
    the tombstones, must outlast all of them."""
    from worker.queue.config import visibility_timeout

    settings = load_settings(redis_url="redis://localhost", search_backend="elasticsearch")
    takes = (settings.task_max_retries + 1) * settings.task_max_deliveries
    assert takes == 12  # the defaults: 4 messages, 3 deliveries each
    assert ingest_redelivery_window(settings) >= takes * visibility_timeout(settings)
    assert settings.elasticsearch_gc_deletes_seconds >= takes * visibility_timeout(settings)
    fewer = load_settings(redis_url="redis://localhost", task_max_retries=0)
    assert ingest_redelivery_window(fewer) < ingest_redelivery_window(settings)


@pytest.mark.parametrize("cap", [30.0, 70.0, 3000.0])
def test_the_webhook_task_s_time_limits_outlast_its_cap(cap: float) -> None:
    # under --pool prefork a soft limit inside the POST left the attempt unrecorded: no
    # retry, no give-up, the webhook owed and sent again by the re-drive for 7 days
    settings = load_settings(redis_url="redis://127.0.0.1:1/0", webhook_total_timeout_seconds=cap)
    conf = celery_config(settings)
    limits = conf["task_annotations"][WEBHOOK_TASK]
    soft, hard = limits["soft_time_limit"], limits["time_limit"]
    assert cap + OUTAGE_SECONDS < soft < hard
    # and the visibility timeout still outlasts every task, the webhook's too
    assert conf["broker_transport_options"]["visibility_timeout"] > hard


def test_a_prefork_pool_left_at_the_threads_concurrency_gets_celery_s_one_child_a_core() -> None:
    """``celery worker`` run by hand on Sift's app with ``SIFT_WORKER_POOL=prefork`` (the
    docs' stack by hand; ``sift worker`` refuses it) forked 300 children, the threads pool's
    default concurrency: left unset, Celery's own default (one child a core) applies."""
    url = "redis://127.0.0.1:1/0"
    assert celery_config(load_settings(redis_url=url))["worker_concurrency"] == 300
    prefork = celery_config(load_settings(redis_url=url, worker_pool="prefork"))
    assert prefork["worker_concurrency"] is None
    chosen = load_settings(redis_url=url, worker_pool="prefork", worker_concurrency=3)
    assert celery_config(chosen)["worker_concurrency"] == 3


def test_a_message_fetched_for_a_queue_no_longer_consumed_goes_back_on_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stop cancels the worker's consumers while a fetch may still be out: kombu then
    delivers a message to a queue with no callback, and requeues it with a WARNING (``No
    consumers``). The message goes back for another worker, as a hand-back does: INFO."""
    from kombu import Connection

    create_celery_app(load_settings(redis_url="redis://127.0.0.1:1/0"))
    with Connection("memory://") as connection:
        channel = connection.default_channel
        channel.queue_declare("sift.batch")
        channel.basic_publish(channel.prepare_message("{}"), exchange="", routing_key="sift.batch")
        fetched = channel._get("sift.batch")  # as a fetch out when the consumer was cancelled
        with caplog.at_level("INFO", logger="kombu.transport.virtual.base"):
            channel.connection._deliver(fetched, "sift.batch")
        assert channel._size("sift.batch") == 1  # back on its queue
    (record,) = [r for r in caplog.records if "No consumers" in r.getMessage()]
    assert record.levelname == "INFO", record.levelname
