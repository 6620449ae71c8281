"""The retry policy of planning's Kafka metadata calls: which errors retry, how long it waits,
and that the adapter retries exactly those (a fake admin client; no broker needed)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import OffsetSpec

from offsetflow.errors import KafkaUnavailableError
from offsetflow.source import KafkaMetadata
from offsetflow.source.retry import RetryPolicy, is_retriable


@pytest.mark.parametrize("code", [
    KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT])
def test_ask_again_errors_retry(code: int) -> None:
    assert is_retriable(code)


@pytest.mark.parametrize("code", [
    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.INVALID_REQUEST, KafkaError.OFFSET_OUT_OF_RANGE])
def test_other_errors_fail_at_once(code: int) -> None:
    assert not is_retriable(code)


def test_backoff_doubles_up_to_its_cap() -> None:
    assert RetryPolicy().delays() == (0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0)
    assert RetryPolicy(attempts=1).delays() == ()
    assert RetryPolicy(attempts=4, base_s=1, cap_s=3).delays() == (1, 2, 3)
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    p = RetryPolicy(attempts=3, base_s=1, cap_s=1, max_elapsed_s=10)
    assert p.may_retry(0, 0.0) and p.may_retry(1, 9.0)
    assert not p.may_retry(1, 9.5)  # the wait would end past the time budget
    assert not p.may_retry(2, 0.0)  # no attempts left


def test_no_retry_starts_past_the_time_budget() -> None:
    admin = _Admin([KafkaError.REQUEST_TIMED_OUT] * 10)
    km = KafkaMetadata({"bootstrap.servers": "b:1"},
                       retry=RetryPolicy(attempts=8, base_s=0.0, cap_s=0.0, max_elapsed_s=0.0))
    km._admin = admin  # type: ignore[assignment]
    with pytest.raises(KafkaUnavailableError, match=r"listing offsets of t\[1\] failed"):
        km._list_offsets({("t", 1): OffsetSpec.earliest()})
    assert admin.calls == 1


class _Done:
    def __init__(self, result: Any = None, error: int | None = None) -> None:
        self._result, self._error = result, error

    def result(self) -> Any:
        if self._error is not None:
            raise KafkaException(KafkaError(self._error))
        return self._result


class _Offset:
    def __init__(self, offset: int) -> None:
        self.offset = offset


class _Admin:
    """list_offsets answers with the queued error codes first (per call), then offsets."""

    def __init__(self, errors: list[int | None]) -> None:
        self.errors = errors
        self.calls = 0

    def poll(self, timeout: float) -> int:  # serves error_cb (nothing to serve here)
        return 0

    def list_offsets(self, req: Any, **_: Any) -> dict[Any, _Done]:
        err = self.errors[self.calls] if self.calls < len(self.errors) else None
        self.calls += 1
        return {tp: _Done(error=err if tp.partition == 1 else None, result=_Offset(42))
                for tp in req}


def _meta(admin: _Admin, attempts: int = 4) -> KafkaMetadata:
    km = KafkaMetadata({"bootstrap.servers": "b:1"},
                       retry=RetryPolicy(attempts=attempts, base_s=0.0, cap_s=0.0))
    km._admin = admin  # type: ignore[assignment]
    return km


def test_listing_offsets_retries_then_succeeds_with_a_warning_per_retry(
        caplog: pytest.LogCaptureFixture) -> None:
    admin = _Admin([KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.NOT_LEADER_FOR_PARTITION])
    with caplog.at_level(logging.WARNING, "offsetflow.source.meta"):
        got = _meta(admin)._list_offsets({("t", 0): OffsetSpec.latest(),
                                          ("t", 1): OffsetSpec.latest()})
    assert got == {("t", 0): 42, ("t", 1): 42} and admin.calls == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "listing offsets of t[1]" in warnings[0]
    assert "retry 1 of 3" in warnings[0] and "retry 2 of 3" in warnings[1]


def test_listing_offsets_gives_up_after_the_last_attempt_naming_the_partition() -> None:
    admin = _Admin([KafkaError.LEADER_NOT_AVAILABLE] * 10)
    with pytest.raises(KafkaUnavailableError,
                       match=r"listing offsets of t\[1\] failed after 4 attempts"):
        _meta(admin)._list_offsets({("t", 1): OffsetSpec.earliest()})
    assert admin.calls == 4


def test_a_non_retriable_error_fails_at_once() -> None:
    admin = _Admin([KafkaError.TOPIC_AUTHORIZATION_FAILED])
    with pytest.raises(KafkaUnavailableError, match=r"listing offsets of t\[1\] failed \("):
        _meta(admin)._list_offsets({("t", 1): OffsetSpec.earliest()})
    assert admin.calls == 1


class _Described:
    def __init__(self, topic_id: Any) -> None:
        self.topic_id = topic_id


class _DescribeAdmin:
    """describe_topics answers with the given topic ids."""

    def __init__(self, ids: dict[str, Any]) -> None:
        self.ids = ids

    def describe_topics(self, topics: Any, **_: Any) -> dict[str, _Done]:
        return {t: _Done(result=_Described(self.ids[t])) for t in topics.topic_names}


def test_a_zero_topic_id_is_no_id() -> None:
    """A broker without topic ids answers the zero Uuid ("AAAAAAAAAAAAAAAAAAAAAA"): taken
    for a real id it would be recorded with positions and compared as one."""
    from confluent_kafka import Uuid

    real = Uuid(12345, 67890)
    km = _meta(_Admin([]))
    km._admin = _DescribeAdmin({"a": Uuid(0, 0), "b": real})  # type: ignore[assignment]
    assert km.topic_ids(["a", "b"]) == {"b": str(real)}


def test_one_retry_budget_for_all_calls_of_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning holds the pipeline's lock across several metadata calls: inside
    `retry_budget()` their retries share one `max_elapsed_s`, instead of each call getting
    its own (several minutes in all)."""
    import offsetflow.source.meta as km_mod

    clock = [0.0]
    monkeypatch.setattr(km_mod.time, "monotonic", lambda: clock[0])

    class _Slow(_Admin):  # every call takes 6 s
        def list_offsets(self, req: Any, **kw: Any) -> dict[Any, _Done]:
            clock[0] += 6.0
            return super().list_offsets(req, **kw)

    def calls(budget: bool) -> None:
        admin = _Slow([KafkaError.REQUEST_TIMED_OUT, None, KafkaError.REQUEST_TIMED_OUT])
        km = KafkaMetadata({"bootstrap.servers": "b:1"},
                           retry=RetryPolicy(attempts=4, base_s=0.0, cap_s=0.0,
                                             max_elapsed_s=10.0))
        km._admin = admin  # type: ignore[assignment]
        specs = {("t", 0): OffsetSpec.latest(), ("t", 1): OffsetSpec.latest()}
        with km.retry_budget() if budget else contextlib.nullcontext():
            km._list_offsets(specs)  # fails at 6 s, retried: done at 12 s
            km._list_offsets(specs)  # fails at 18 s: past the plan's 10 s budget?

    calls(budget=False)  # each call its own 10 s: both succeed
    with pytest.raises(KafkaUnavailableError, match="listing offsets of t\\[1\\] failed"):
        calls(budget=True)
