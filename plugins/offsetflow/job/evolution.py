"""`format.schema_evolution` on the driver: after the tasks staged a batch and before its
commit, check the schema changes the batch holds (`check_schema_changes`).

The chain checked per topic, in the order the registry gave the ids: the schema ids the
pipeline's last committed batch read (its reader and writers, from the ledger), the writer
ids the batch's markers name, and (add_columns) this run's reader schema, whose fields are
the columns. Each schema must follow the one before (`source.incompatibilities`); under
`fail`, a writer schema whose fields differ from the one before stops the batch too. A stop
raises `SchemaEvolutionError` naming the topic, both ids with their versions in the subject,
and the first offset of the new schema; it is raised before the commit transaction opens
(or, for a part-wise append, before it commits), so nothing is written and no position
moves.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from offsetflow.config import PipelineConfig
from offsetflow.errors import SchemaEvolutionError
from offsetflow.job.tasks import ReadContext, resolves_latest
from offsetflow.ledger import Ledger
from offsetflow.stage import staged_schema_ids

log = logging.getLogger(__name__)


def check_schema_changes(cfg: PipelineConfig, rc: ReadContext, ledger: Ledger,
                         batch_id: int) -> None:
    """Raise SchemaEvolutionError when the batch holds a change its policy refuses."""
    from offsetflow.source import SCHEMA_TYPES

    kind = SCHEMA_TYPES.get(cfg.format_type)
    if cfg.schema_evolution is None or rc.registry is None or kind is None:
        return
    from offsetflow.source import (
        RegistryClient,
        incompatibilities,
        schema_fields,
        subject_of,
        unreadable,
    )

    compat = functools.partial(incompatibilities, schema_type=kind)
    fields = functools.partial(schema_fields, schema_type=kind)
    readable = functools.partial(unreadable, schema_type=kind)

    with ledger.transaction() as cur:
        writers = staged_schema_ids(cur, batch_id)
    before = ledger.last_schemas(cfg.name) or {}
    client = RegistryClient.of(rc.registry)
    readers = rc.readers or {}
    for topic in sorted(set(writers) | {t for t, r in readers.items() if r is not None}):
        firsts: dict[int, list[int]] = {int(k): v for k, v in writers.get(topic, {}).items()}
        earlier = _earlier_ids(before, topic)
        reader = readers.get(topic)
        chain = set(firsts) | set(earlier)
        if cfg.schema_evolution == "add_columns" and reader is not None:
            chain.add(reader[0])
        texts: dict[int, str] = {}
        # the reader is read under either policy: the pair-wise check below uses it
        for sid in sorted(chain | ({reader[0]} if reader is not None else set())):
            found = client.schema_by_id(sid, serialized=kind == "PROTOBUF")
            # an id the registry lacks or of another type: its records are dead letters
            if found is None or found.schema_type != kind:
                continue
            why_not = _unreadable_why(fields, found.schema)
            if why_not is None:
                texts[sid] = found.schema
            elif kind == "JSON" or (kind == "PROTOBUF" and sid in firsts
                                    and _builds(sid, found.schema)):
                # the tasks read its records (JSON Schema: they check the id only): a
                # schema the rules cannot read is not passed unchecked
                raise SchemaEvolutionError(_unchecked(cfg, topic, sid, why_not,
                                                      firsts.get(sid), client))
            # else its records are dead letters: an Avro writer that is not a record does
            # not resolve to the reader, a Protobuf file the tasks cannot build either
        reader_text = texts.get(reader[0]) if reader is not None else None
        ids = sorted(i for i in texts if i in chain)
        # the ids the last batch read are checked only as the start of the chain
        start = max((i for i in ids if i in earlier), default=None)
        ids = [i for i in ids if i not in earlier or i == start]
        for old, new in zip(ids, ids[1:], strict=False):
            why = _refused(cfg.schema_evolution, texts[old], texts[new], compat, fields,
                           new in firsts)
            if why:
                raise SchemaEvolutionError(_message(
                    cfg, topic, old, new, why, firsts.get(new),
                    client.version_in(old, subject_of(topic)),
                    client.version_in(new, subject_of(topic)),
                    reader is not None and reader[0] == new))
        if reader is not None and reader_text is not None:
            _check_read_by(cfg, topic, reader, firsts, texts, client, readable)


def _check_read_by(cfg: PipelineConfig, topic: str, reader: tuple[int, str],
                   firsts: dict[int, list[int]], texts: dict[int, str], client: Any,
                   unreadable: Any) -> None:
    """Every writer schema of the batch against the reader schema its records decode with,
    pair by pair: the chain checks neighbours only, and a field removed then re-added with
    another type passes each step while the first writer's records no longer decode (they
    would land in the dead letters as bad records)."""
    from offsetflow.source import subject_of

    for sid in sorted(firsts):
        if sid == reader[0] or sid not in texts:
            continue
        why = unreadable(texts[sid], reader[1])
        if why:
            at = firsts[sid]
            raise SchemaEvolutionError(
                f"pipeline {cfg.name}: topic {topic}: records written with schema id {sid} "
                f"(version {client.version_in(sid, subject_of(topic))} of {topic}-value) "
                f"cannot be read as the batch's reader schema id {reader[0]} (version "
                f"{client.version_in(reader[0], subject_of(topic))}): {'; '.join(why)}; its "
                f"first record in the batch is {topic}[{at[0]}]@{at[1]}. Nothing of the "
                f"batch was written and no position moved; " + (
                    "pin format.schema_registry.reader_version to a version that reads both "
                    "(or declare the field in format.schema)" if cfg.format_type == "avro"
                    else "declare the field in format.schema with a type both versions "
                    "fit, or remove format.schema_evolution,") +
                " and run with --accept-config-change")


def pinned_readers(cfg: PipelineConfig, ledger: Ledger, batch_id: int,
                   specs: list[dict[str, Any]], part: str = "value"
                   ) -> dict[str, tuple[int, str] | None] | None:
    """Avro (and Protobuf or JSON Schema, `resolves_latest`): each topic's
    value reader schema (id, text) for this run of the batch (`part` key: its
    `<topic>-key` reader schema, format.key avro): the ones its first run resolved (pinned
    in the ledger), so a version registered between a failed run and its retry changes
    neither the columns nor how the records (or keys) decode (the retry reuses what the
    first run staged). None for other formats."""
    from offsetflow.source import SCHEMA_TYPES

    kind = "AVRO" if part == "key" else SCHEMA_TYPES.get(cfg.format_type)
    if cfg.registry is None or kind is None or (part == "key" and cfg.key_format != "avro") \
            or (part == "value" and kind != "AVRO" and not resolves_latest(cfg)):
        return None
    from offsetflow.errors import SchemaRegistryError
    from offsetflow.source import RegistryClient, reader_schemas, registry_settings, value_schemas

    reg = cfg.registry
    client = RegistryClient.of(registry_settings(reg.url, reg.username, reg.password,
                                                 reg.timeout_s))
    topics = [str(s["topic"]) for s in specs]
    if part == "key":
        latest = reader_schemas(client, topics, None, part="key")
    else:
        latest = reader_schemas(client, topics, reg.reader_version) if kind == "AVRO" \
            else value_schemas(client, topics, kind, strict=cfg.schema_evolution is not None)
    ids = {t: None if r is None else r[0] for t, r in latest.items()}
    pinned = ledger.pin_reader_schemas(batch_id, ids, part)
    what = "keys" if part == "key" else "records"
    out: dict[str, tuple[int, str] | None] = {}
    for topic, now in latest.items():
        want = pinned.get(topic, ids[topic])
        if want == ids[topic]:
            out[topic] = now
            continue
        log.info("batch %d: the %s of topic %s are read with reader schema id %s, pinned by "
                 "the batch's first run (the subject's latest is now %s)", batch_id, what,
                 topic, want, ids[topic])
        if want is None:
            out[topic] = None
            continue
        found = client.schema_by_id(int(want), serialized=kind == "PROTOBUF")
        if found is None:
            raise SchemaRegistryError(
                client.shown, f"schema id {want}", f"the reader schema this batch's first run "
                f"read the {what} of {topic} with is gone from the registry (run the batch "
                f"with --accept-config-change after a config change, or abandon it)",
                retriable=False)
        out[topic] = (int(want), found.schema)
    return out


def _unreadable_why(fields: Any, text: str) -> str | None:
    """Why the evolution rules cannot read a schema's fields (None: they can)."""
    try:
        fields(text)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return str(e) or type(e).__name__
    return None


def _builds(sid: int, text: str) -> bool:
    """Whether the Spark tasks can build a Protobuf schema (else its records are dead
    letters, as `source.protobuf` says)."""
    from offsetflow.source import protobuf_builds

    return protobuf_builds(sid, text)


def _unchecked(cfg: PipelineConfig, topic: str, sid: int, why: str, first: list[int] | None,
               client: Any) -> str:
    from offsetflow.source import subject_of

    where = (f"its first record in the batch is {topic}[{first[0]}]@{first[1]}"
             if first is not None else "it is the subject's latest, the batch's reader")
    return (f"pipeline {cfg.name}: topic {topic}: schema id {sid} (version "
            f"{client.version_in(sid, subject_of(topic))} of {topic}-value) is one "
            f"format.schema_evolution cannot read the fields of ({why}), while the tasks "
            f"read its records; {where}. Nothing of the batch was written and no position "
            f"moved; remove format.schema_evolution and run the batch with "
            f"--accept-config-change (records are then read as format.schema declares), or "
            f"register a version whose root is an object with properties (a message)")


def _earlier_ids(before: dict[str, Any], topic: str) -> set[int]:
    ids = {int(k) for k in (before.get("writers") or {}).get(topic, {})}
    r = (before.get("readers") or {}).get(topic)
    if r is not None:
        ids.add(int(r))
    return ids


def _refused(policy: str, old: str, new: str, incompatibilities: Any, schema_fields: Any,
             in_batch: bool) -> list[str]:
    why: list[str] = incompatibilities(old, new)
    if why or policy != "fail" or not in_batch:
        return why
    o, n = schema_fields(old), schema_fields(new)
    added = [f for f in n if f not in o]
    removed = [f for f in o if f not in n]
    changed = [f for f in n if f in o and n[f].base != o[f].base]
    return ([f"fields added {added}"] if added else []) + \
        ([f"fields removed {removed}"] if removed else []) + \
        ([f"field types changed {changed}"] if changed else [])


def _message(cfg: PipelineConfig, topic: str, old: int, new: int, why: list[str],
             first: list[int] | None, v_old: int | None, v_new: int | None,
             is_reader: bool) -> str:
    def named(sid: int, v: int | None) -> str:
        return f"schema id {sid} (version {v} of {topic}-value)" if v is not None \
            else f"schema id {sid} (not a version of {topic}-value)"

    where = (f"its first record in the batch is {topic}[{first[0]}]@{first[1]}"
             if first is not None else
             "no record of the batch was written with it (it is the reader schema, the "
             "subject's latest" + (" pinned version" if cfg.registry and
                                   cfg.registry.reader_version else "") + ")"
             if is_reader else "no record of the batch was written with it")
    if cfg.schema_evolution == "fail" and not any("not a widening" in w or "removed" in w
                                                    or "without a default" in w
                                                    or "null" in w for w in why):
        out = ("format.schema_evolution is fail: declare the change in format.schema (and "
               "run with --accept-config-change), or set schema_evolution: add_columns")
    else:
        out = ("records already written keep their schema id, so for this batch: remove "
               "format.schema_evolution and run it with --accept-config-change (records "
               "are then read as format.schema declares; those that cannot be are dead "
               "letters), or abandon it; and register a compatible version for the "
               "producers (a default for an added field, a widening instead of a "
               "narrowing) so later batches do not stop")
    return (f"pipeline {cfg.name}: topic {topic}: {named(new, v_new)} cannot follow "
            f"{named(old, v_old)}: {'; '.join(why)}; {where}. Nothing of the batch was "
            f"written and no position moved; {out}")
