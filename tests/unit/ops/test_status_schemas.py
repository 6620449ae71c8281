"""The schema ids of a batch on `offsetflow status` and the lag page, with the subject and
version of each (`offsetflow.ops.schema_summary`)."""

from __future__ import annotations


def test_schema_summary_names_subject_and_version_or_says_unknown() -> None:
    from offsetflow.ops import schema_summary

    schemas = {"readers": {"o": 8}, "writers": {"o": {"7": [0, 3], "8": [1, 5]}}}
    assert schema_summary(schemas) == \
        "o: read as 8, written 7 (from [0]@3), 8 (from [1]@5)"
    versions = {"o": {"7": {"subject": "o-value", "version": 2, "known": True},
                      "8": {"subject": "o-value", "version": None, "known": True}}}
    assert schema_summary(schemas, versions) == (
        "o: read as 8 (not in o-value), written 7 (o-value v2, from [0]@3), "
        "8 (not in o-value, from [1]@5)")
    down = {"o": {k: {"subject": "o-value", "version": None, "known": False}
                  for k in ("7", "8")}}
    assert schema_summary(schemas, down) == (
        "o: read as 8 (version unknown: registry not answering), written 7 (version "
        "unknown: registry not answering, from [0]@3), 8 (version unknown: registry not "
        "answering, from [1]@5)")
