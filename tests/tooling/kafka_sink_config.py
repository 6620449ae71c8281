"""A `sink.type: kafka` pipeline for the sink's pure tests: its raw config (the sink's fields
given), the environment its `${VAR}`s read, and a running batch of it."""

from __future__ import annotations

from typing import Any

from offsetflow.ledger import Batch
from offsetflow.ranges import OffsetRange

ENV = {"OFFSETFLOW_PG_DSN": "postgresql://u:secret@h:1/db"}


def raw(**sink: Any) -> dict[str, Any]:
    return {"kafka": {"bootstrap_servers": "127.0.0.1:19092"},
            "source": {"topics": ["orders"]},
            "format": {"type": "json", "schema": {"id": "string", "amount": "double"}},
            "sink": {"type": "kafka", **sink}}


def batch(bid: int = 7, kind: str = "scheduled", moves: bool = True,
          target: str = "kafka:out") -> Batch:
    return Batch(bid, "orders", kind, "running",
                 (OffsetRange("in", 0, 10, 20), OffsetRange("in", 1, 5, 5)),
                 target, moves_positions=moves)
