"""Transient Kafka errors while reading: retried with bounded backoff, never forever and
never fatal at the first one (pure logic: a stand-in consumer, no broker)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError, KafkaException

from offsetflow.errors import RangeReadError
from offsetflow.ranges import OffsetRange
from offsetflow.source.reader import Backoff, handle_error, watermarks

R = OffsetRange("t", 0, 0, 100)


class FlakyConsumer:
    """get_watermark_offsets fails `failures` times with `code`, then answers."""

    def __init__(self, failures: int, code: int = KafkaError.LEADER_NOT_AVAILABLE) -> None:
        self.failures, self.code, self.calls = failures, code, 0

    def get_watermark_offsets(self, tp: object, timeout: float) -> tuple[int, int]:
        self.calls += 1
        if self.calls <= self.failures:
            raise KafkaException(KafkaError(self.code))
        return 5, 100


def test_watermarks_are_retried_through_a_leader_change() -> None:
    c = FlakyConsumer(2)
    assert watermarks(c, R) == (5, 100)  # type: ignore[arg-type]
    assert c.calls == 3


def test_watermarks_give_up_within_their_bound() -> None:
    c = FlakyConsumer(10**6)
    t0 = time.monotonic()
    assert watermarks(c, R, limit_s=0.5) == (-1, -1)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 5 and c.calls >= 2


def test_watermarks_do_not_retry_a_permanent_error() -> None:
    c = FlakyConsumer(10**6, KafkaError.TOPIC_AUTHORIZATION_FAILED)
    assert watermarks(c, R) == (-1, -1)  # type: ignore[arg-type]
    assert c.calls == 1


@pytest.mark.parametrize("code", [KafkaError.NOT_LEADER_FOR_PARTITION,
                                  KafkaError.FENCED_LEADER_EPOCH, KafkaError._TRANSPORT])
def test_transient_errors_back_off_then_fail_naming_the_range(code: int) -> None:
    backoff = Backoff(0.3, steps=(0.05, 0.1))
    t0 = time.monotonic()
    with pytest.raises(RangeReadError) as e:
        for _ in range(1000):
            assert handle_error(FlakyConsumer(0), R, KafkaError(code), None, 7,  # type: ignore[arg-type]
                                 backoff) == 7
    waited = time.monotonic() - t0
    assert 0.3 < waited < 3  # backed off (no busy loop), and gave up at the bound
    assert "transient Kafka errors" in str(e.value) and "t" in str(e.value)
    assert backoff.failures < 20


def test_progress_resets_the_backoff() -> None:
    b = Backoff(10, steps=(0.01, 0.02, 0.04))
    assert b.wait() and b.wait()
    assert b.failures == 2
    b.reset()
    assert b.failures == 0 and b.since is None
