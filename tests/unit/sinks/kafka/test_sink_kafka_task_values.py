"""What a task does with a record whose value it cannot build (review s39-kfiles item 9): a
bad record naming the column, never an error that fails the task on every attempt; and a
file gone under the driver's read (item 12): a lost part, never a raw OSError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from offsetflow.sinks.kafka.taskfile import KafkaTaskFiles, read_part_file
from tests.tooling.kafka_sink_shape import KafkaSinkShape

YEAR1_US = -62_135_596_800_000_000  # 0001-01-01T00:00:00Z
YEAR10000_US = 253_402_300_800_000_000  # 10000-01-01T00:00:00Z
DAY_US = 86_400_000_000


def _batch(n: int, col: str, values: pa.Array) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({
        "topic": ["src"] * n, "partition": pa.array([0] * n, pa.int32()),
        "offset": pa.array(range(n), pa.int64()),
        "timestamp": pa.array([1_700_000_000_000_000] * n, pa.int64()).cast(
            pa.timestamp("us", "UTC")),
        "key": [f"k{i}".encode() for i in range(n)], "value": [b"{}"] * n,
        "headers": pa.nulls(n, pa.string()), "n": pa.array(range(n), pa.int64()),
        col: values})


@pytest.mark.parametrize("shape", ["timestamptz value", "timestamp value", "date value",
                                   "timestamptz key", "date raw value"])
def test_a_value_outside_years_1_to_9999_is_a_bad_record_the_rest_written(
        tmp_path: Path, shape: str) -> None:
    """A timestamp or date before year 1 or after 9999 in a column the sink reads (the
    readers refuse them first today; a later reader or a column evolved might not): that
    record is a bad record naming the column and why, the part's other records go to its
    file, and the task goes on."""
    pg_type = {"timestamptz": "timestamptz", "timestamp": "timestamp",
               "date": "date"}[shape.split()[0]]
    if pg_type == "date":
        days = [YEAR1_US // DAY_US - 1, 0, YEAR10000_US // DAY_US, 19_000]
        values = pa.array(days, pa.int32()).cast(pa.date32())
    else:
        us = [YEAR1_US - 1, 0, YEAR10000_US, 1_700_000_000_000_000]
        values = pa.array(us, pa.int64()).cast(
            pa.timestamp("us", "UTC" if pg_type == "timestamptz" else None))
    cfg = KafkaSinkShape()
    if shape.endswith("key"):
        cfg.key_column = "at"
    if "raw" in shape:
        cfg.value_format, cfg.value_column = "raw", "at"
    columns = {"topic": "text", "partition": "integer", "offset": "bigint",
               "timestamp": "timestamptz", "key": "bytea", "value": "bytea",
               "headers": "jsonb", "n": "bigint", "at": pg_type}
    tf = KafkaTaskFiles(str(tmp_path), "L", 3, cfg, columns)
    w = tf.writer(0)
    written, rest = w.write(_batch(4, "at", values))
    assert rest is None
    bad = w.take_unfit()
    assert [b["offset"] for b in bad] == [0, 2], bad
    for b in bad:
        assert "'at'" in b["error"] and "years 1-9999" in b["error"], b["error"]
        assert (b["topic"], b["partition"], b["key"]) == ("src", 0, f"k{b['offset']}".encode())
    assert written.num_rows == 2 and written.column("offset").to_pylist() == [1, 3]
    entry = w.close()[0]
    assert entry["records"] == 2
    got = pa.Table.from_batches(list(read_part_file(3, 0, entry)))
    assert got.column("offset").to_pylist() == [1, 3]


def test_a_file_gone_between_its_check_and_its_mapping_is_a_lost_part(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file removed after its CRC-32 was checked, before it is mapped (a sweep, a
    reaper: review s39-kfiles item 12): a `TaskFileLostError` naming batch, part and path
    (the part dropped and re-staged), not a raw OSError failing the commit."""
    from offsetflow.errors import TaskFileLostError
    from offsetflow.sinks.kafka import taskfile

    tf = KafkaTaskFiles(str(tmp_path), "L", 3, KafkaSinkShape(), {
        "topic": "text", "partition": "integer", "offset": "bigint",
        "timestamp": "timestamptz", "key": "bytea", "value": "bytea", "headers": "jsonb",
        "n": "bigint", "at": "bigint"})
    w = tf.writer(0)
    w.write(_batch(3, "at", pa.array([1, 2, 3], pa.int64())))
    entry = w.close()[0]
    real = taskfile.pa.memory_map

    def gone_first(path: str, *args: Any) -> Any:
        Path(path).unlink()
        return real(path, *args)

    monkeypatch.setattr(taskfile.pa, "memory_map", gone_first)
    with pytest.raises(TaskFileLostError) as e:
        list(read_part_file(3, 0, entry))
    assert str(entry["path"]) in str(e.value) and "part 0" in str(e.value), str(e.value)
