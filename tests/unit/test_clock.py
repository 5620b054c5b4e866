"""The shared clock (:mod:`worker.clock`) on a fake monotonic and wall clock: Redis's time
carried forward, a surer reading kept over a slower one, the skew measured."""

from __future__ import annotations

from worker.clock import MAX_DRIFT, SharedClock


class Clocks:
    """A host's two clocks, moved by hand: its wall clock ``skew`` seconds off Redis's."""

    def __init__(self, skew: float) -> None:
        self.mono = 100.0
        self.skew = skew
        self.redis = 1_800_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.redis + self.skew

    def tick(self, seconds: float) -> None:
        self.mono += seconds
        self.redis += seconds

    def time_reply(self, round_trip: float, read_at: float = 0.5) -> tuple[int, int]:
        """Redis's ``TIME`` answered over ``round_trip`` seconds, read ``read_at`` of the way."""
        self.tick(round_trip * read_at)
        seconds, micros = int(self.redis), round((self.redis % 1) * 1_000_000)
        self.tick(round_trip * (1 - read_at))
        return seconds, micros


def test_before_any_reading_it_is_the_host_s_wall_clock() -> None:
    clocks = Clocks(skew=360.0)
    clock = SharedClock(monotonic=clocks.monotonic, wall=clocks.wall)
    assert clock.now() == clocks.wall() and clock.skew() is None and clock.stale()


def test_a_reading_carries_redis_s_time_forward_and_measures_the_skew() -> None:
    clocks = Clocks(skew=-360.0)
    clock = SharedClock(monotonic=clocks.monotonic, wall=clocks.wall)
    assert abs(clock.read(lambda: clocks.time_reply(0.002)) + 360.0) < 0.002
    clocks.tick(25.0)
    assert abs(clock.now() - clocks.redis) < 0.002
    assert not clock.stale(30.0)
    clocks.tick(10.0)
    assert clock.stale(30.0)


def test_a_slow_round_trip_does_not_replace_a_surer_reading() -> None:
    clocks = Clocks(skew=0.0)
    clock = SharedClock(monotonic=clocks.monotonic, wall=clocks.wall)
    clock.read(lambda: clocks.time_reply(0.001))
    # Redis read its clock at the very start of a 0.8 s round trip: half of it, taken as
    # the reading's time, would put this clock 0.4 s behind
    clock.read(lambda: clocks.time_reply(0.8, read_at=0.0))
    assert abs(clock.now() - clocks.redis) < 0.001
    # a reading aged past the drift it may have taken is replaced by the next one
    clocks.tick(0.4 / MAX_DRIFT)
    clock.read(lambda: clocks.time_reply(0.8, read_at=0.0))
    assert abs(clock.now() - clocks.redis + 0.4) < 0.001
