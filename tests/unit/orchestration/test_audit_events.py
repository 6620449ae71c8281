"""The events of a published audit (issue 33 item 4): the Asset event's extra has a batch's
shape for the whole window, and only a publish that changed something sends anything; a
failure to send is a message, never an exception (the publish has committed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from offsetflow.orchestration.audit_events import audit_extra, report_publish, target_uri

CFG: Any = SimpleNamespace(name="orders", bootstrap_servers="k1:9092,k2:9092", schema=None,
                           sink=SimpleNamespace(connection="host=db port=5433 dbname=shop",
                                                table="orders"))
RANGES = [{"topic": "t", "partition": 0, "from_offset": 0, "until_offset": 10},
          {"topic": "t", "partition": 1, "from_offset": 0, "until_offset": 5}]
PUBLISHED = {"audit_id": 7, "changed": True, "status": "published", "rows": 15,
             "target_table": "orders", "pipeline": "orders", "kind": "replay",
             "window": RANGES,
             "batches": [{"batch_id": 7, "kind": "replay", "rows_written": 10,
                          "records_read": 10, "bad_records": 0, "target_table": "orders",
                          "ranges": RANGES[:1]},
                         {"batch_id": 8, "kind": "replay", "rows_written": 5,
                          "records_read": 6, "bad_records": 1, "target_table": "orders",
                          "ranges": RANGES[1:]}]}


def test_extra_is_a_batch_extra_of_the_whole_window_with_its_batches() -> None:
    e = audit_extra(CFG, PUBLISHED)
    assert target_uri(CFG, PUBLISHED) == "postgres://db:5433/shop/public/orders"
    assert (e["pipeline"], e["batch_id"], e["audit_id"], e["kind"]) == ("orders", 7, 7,
                                                                       "replay")
    assert (e["rows_written"], e["records_read"], e["bad_records"]) == (15, 16, 1)
    assert e["published_rows"] == 15 and e["target_table"] == "orders"
    assert e["ranges"] == RANGES and e["inputs"] == ["kafka://k1:9092/t"]
    assert [(b["batch_id"], b["rows_written"], b["ranges"]) for b in e["batches"]] == [
        (7, 10, RANGES[:1]), (8, 5, RANGES[1:])]


def test_a_rerun_that_changed_nothing_sends_nothing() -> None:
    assert report_publish(CFG, {"audit_id": 7, "status": "published", "changed": False},
                          no_asset="must not be looked at") == []


def test_an_event_that_cannot_be_sent_is_reported_not_raised() -> None:
    notes = report_publish(CFG, PUBLISHED, no_asset="no --airflow-url given")
    assert notes[0] == ("audit 7 is published (committed), but its Airflow asset event was "
                        "not sent: no --airflow-url given")


def test_an_unreachable_airflow_is_said_and_the_publish_stands() -> None:
    from offsetflow.cli.airflow_api import AirflowApi

    notes = report_publish(CFG, PUBLISHED, AirflowApi("http://127.0.0.1:9", "token"))
    assert "Airflow asset event was not sent" in notes[0]
    assert "cannot reach Airflow's API server" in notes[0]
    assert notes[0].startswith("audit 7 is published (committed)")
