"""ConsumerIntake: the consumer's prefetch count down to 1 while paused, given back once."""

from __future__ import annotations

from kombu.common import QoS

from worker.queue.intake import ConsumerIntake


class Hub:
    def __init__(self) -> None:
        self.woken = 0

    def call_soon(self, callback: object) -> None:
        self.woken += 1


class Consumer:
    def __init__(self, prefetch: int) -> None:
        self.counts: list[int] = []
        self.qos = QoS(lambda prefetch_count: self.counts.append(prefetch_count), prefetch)
        self.hub = Hub()


def test_pause_takes_the_prefetch_count_to_one_and_resume_gives_it_back() -> None:
    consumer = Consumer(300)
    intake = ConsumerIntake()
    intake.resume()  # nothing paused: nothing to give back
    intake.attach(consumer)
    intake.pause()
    intake.pause()  # already paused
    assert consumer.qos.value == 1
    consumer.qos.increment_eventually()  # Celery's own change meanwhile (an ETA task)
    intake.resume()
    intake.resume()  # given back once
    assert consumer.qos.value == 301
    assert consumer.hub.woken == 1  # the event loop goes round to apply it
    consumer.qos.update()
    assert consumer.counts[-1] == 301


def test_a_new_consumer_after_a_reconnect_is_not_given_the_old_ones_count() -> None:
    intake = ConsumerIntake()
    intake.attach(Consumer(300))
    intake.pause()
    fresh = Consumer(300)
    intake.attach(fresh)
    intake.resume()
    assert fresh.qos.value == 300


def test_without_a_consumer_it_does_nothing() -> None:
    intake = ConsumerIntake()
    intake.pause()
    intake.resume()
