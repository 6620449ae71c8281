"""The `json` field type of the JSON formats (`format.type: json`, `json_schema`): any JSON
value of the field, nested or not, lands as the text of a jsonb column, exactly."""

from __future__ import annotations

import json

from offsetflow.source import deserialize_json

SCHEMA = {"id": "long", "doc": "json"}


def test_nested_values_land_as_their_json_text_numbers_exact() -> None:
    values = [
        b'{"id": 1, "doc": {"a": [1, 2.50, {"b": null}], "c": "\\u00e9"}}',
        b'{"id": 2, "doc": [true, 12345678901234567890.123456789]}',
        b'{"id": 3, "doc": "just text"}',
        b'{"id": 4}',  # missing: SQL NULL
        b'{"id": 5, "doc": null}',  # JSON null: SQL NULL too
        b'{"id": 6, "doc": {"nul": "a\\u0000b"}}',  # jsonb cannot hold NUL: a dead letter
    ]
    table, bad, good = deserialize_json(values, SCHEMA)
    assert good == [0, 1, 2, 3, 4] and [b.index for b in bad] == [5]
    assert "NUL" in bad[0].reason and "'doc'" in bad[0].reason
    docs = table.column("doc").to_pylist()
    assert json.loads(docs[0]) == {"a": [1, 2.5, {"b": None}], "c": "é"}
    assert docs[1] == "[true,12345678901234567890.123456789]"  # every digit kept
    assert docs[2] == '"just text"' and docs[3] is None and docs[4] is None
    assert table.column("id").to_pylist() == [1, 2, 3, 4, 5]


def test_a_large_chunk_with_a_json_field_is_read_whole() -> None:
    values = [json.dumps({"id": i, "doc": {"i": i}}).encode() for i in range(3000)]
    table, bad, good = deserialize_json(values, SCHEMA)
    assert not bad and good == list(range(3000))
    assert table.column("doc").to_pylist()[2999] == '{"i":2999}'
