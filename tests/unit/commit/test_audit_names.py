"""Pure parts of audit before publish: the shadow's name, window overlap, the request flag."""

from __future__ import annotations

import pytest

from offsetflow.commit import Audit, shadow_name
from offsetflow.errors import RequestError
from offsetflow.plan import parse_request


def test_shadow_sits_beside_the_live_table_and_fits_postgres_names() -> None:
    assert shadow_name("orders", 17) == "public.orders__audit_17"
    assert shadow_name("sales.orders", 17) == "sales.orders__audit_17"
    long = "x" * 60
    name = shadow_name(f"s.{long}", 123456)
    assert name.startswith("s.offsetflow_audit_123456_") and len(name.split(".")[1]) == 63


def _audit(*ranges: tuple[str, int, int, int]) -> Audit:
    return Audit(1, "p", "replay", (1,), "t", "t__audit_1", None, None,
                 tuple({"topic": t, "partition": p, "from_offset": lo, "until_offset": hi}
                       for t, p, lo, hi in ranges), "audited")


def test_windows_overlap_per_topic_partition_half_open() -> None:
    a = _audit(("t", 0, 10, 20))
    def r(t: str, p: int, lo: int, hi: int) -> list[dict[str, object]]:
        return [{"topic": t, "partition": p, "from_offset": lo, "until_offset": hi}]
    assert a.overlaps(r("t", 0, 19, 30))
    assert not a.overlaps(r("t", 0, 20, 30))  # until is exclusive
    assert not a.overlaps(r("t", 1, 10, 20))
    assert not a.overlaps(r("u", 0, 10, 20))


def test_audit_is_a_flag_of_the_request() -> None:
    base = {"pipeline": "p", "from_offset": 0, "until_offset": 5}
    assert not parse_request("replay", base).audit
    assert parse_request("backfill", {**base, "audit": "true"}).audit
    with pytest.raises(RequestError, match="audit must be true or false"):
        parse_request("replay", {**base, "audit": "maybe"})
