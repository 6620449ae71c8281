"""Every failure a user can act on has its own small exception type.

Each is raised where the problem is detected and carries the coordinates the user
needs (file and field, topic/partition/offset, batch id) so it is shown once, clearly.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence


class OffsetFlowError(Exception):
    """Base of every error OffsetFlow raises on purpose."""


class ConfigError(OffsetFlowError):
    """A pipeline config is invalid; names the file and the field.

    One raised for a whole file carries every error found in it (`errors`, one line each in
    its message); its own source, field and message are the first's, so a caller that reads
    one error reads the first. `line`/`column` (1-based) say where the field is in the YAML
    when the file was read from disk; `at_key`: the error is about the key (an unknown
    field), not its value."""

    def __init__(self, source: str, field: str, message: str, *, at_key: bool = False,
                 others: Sequence[ConfigError] = ()) -> None:
        self.source = source
        self.field = field
        self.message = message
        self.at_key = at_key
        self.line: int | None = None
        self.column: int | None = None
        self.errors: tuple[ConfigError, ...] = (self, *others)
        super().__init__("\n".join(f"{e.source}: {e.field}: {e.message}" for e in self.errors))

    @classmethod
    def of(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error for all of `errors` (not empty), in their order."""
        first, *rest = [e for err in errors for e in err.errors]
        if not rest:
            return first
        one = cls(first.source, first.field, first.message, at_key=first.at_key, others=rest)
        one.line, one.column = first.line, first.column
        return one


class SettingError(OffsetFlowError):
    """A deployment setting ([offsetflow] in airflow.cfg, its environment variable) points
    at something that is not there; names the option and how to set it."""


class AirflowApiError(OffsetFlowError):
    """Airflow's REST API refused or could not be reached (URL, HTTP status, what to set)."""


class InvalidRangeError(OffsetFlowError, ValueError):
    """An OffsetRange that cannot exist (negative offsets, until < from)."""


class DataLossError(OffsetFlowError):
    """Offsets the pipeline still had to read are gone from Kafka (retention, deletion).

    `missing_from`/`missing_until` is the half-open range of offsets that can no longer
    be read, so the operator knows exactly what was lost.
    """

    def __init__(
        self, topic: str, partition: int, missing_from: int, missing_until: int, detail: str = ""
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.missing_from = missing_from
        self.missing_until = missing_until
        msg = (
            f"data loss on {topic}[{partition}]: offsets [{missing_from}, {missing_until}) "
            f"({missing_until - missing_from} offsets) are no longer in Kafka"
        )
        if detail:
            msg += f"; {detail}"
        super().__init__(msg)


class OffsetsResetError(OffsetFlowError):
    """A partition's log end is below the committed position: the topic was deleted and
    recreated, or truncated. Reading on would silently skip or re-read data."""

    def __init__(self, topic: str, partition: int, committed: int, log_end: int) -> None:
        self.topic = topic
        self.partition = partition
        self.committed = committed
        self.log_end = log_end
        super().__init__(
            f"{topic}[{partition}]: committed position {committed} is beyond the log end "
            f"{log_end}; the topic was probably deleted and recreated. Reset the position "
            f"explicitly (offsetflow reset-position) after checking what happened."
        )


class TopicRecreatedError(OffsetFlowError):
    """The topic now has another Kafka topic id than the committed positions (or an open
    batch) belong to: it was deleted and recreated, so its offsets mean something else.
    Nothing is planned or read; the message gives the commands of the way out."""

    def __init__(self, topic: str, committed_id: str, current_id: str,
                 partitions: Sequence[int] = (), pipeline: str | None = None,
                 batch_id: int | None = None) -> None:
        self.topic = topic
        self.committed_id = committed_id
        self.current_id = current_id
        self.partitions = tuple(partitions)
        self.batch_id = batch_id
        p = f"-p {pipeline}" if pipeline else "-p PIPELINE"
        reset = (f"offsetflow reset-position {p} --topic {topic} --all-partitions --offset 0 "
                 f"--reason '...' (add --archive-to TABLE when the sink holds the old "
                 f"topic's rows)")
        if batch_id is not None:
            msg = (f"batch {batch_id} was planned for topic {topic} with topic id "
                   f"{committed_id}, but {topic} was deleted and recreated (topic id now "
                   f"{current_id}); its ranges name the old topic's offsets, so nothing was "
                   f"read. Abandon it (offsetflow abandon --batch-id {batch_id} --reason "
                   f"'...'), then reset the positions: {reset}")
        else:
            parts = f" of partition(s) {list(self.partitions)}" if self.partitions else ""
            msg = (f"topic {topic} was deleted and recreated (topic id {committed_id} -> "
                   f"{current_id}); its offsets restarted and the committed positions{parts} "
                   f"belong to the old topic. Check what was lost, then reset them: {reset}")
        super().__init__(msg)


class PositionResetError(OffsetFlowError):
    """A position reset would make the pipeline write records whose coordinates are already
    taken by rows in the sink (e.g. rows of a topic's earlier incarnation)."""


class BadRecordError(OffsetFlowError):
    """A record could not be deserialized and the pipeline's bad-record policy is `fail`."""

    def __init__(self, topic: str, partition: int, offset: int, reason: str, more: int = 0) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.reason = reason
        self.more = more
        extra = f" (and {more} more bad records in this batch)" if more else ""
        super().__init__(
            f"bad record at {topic}[{partition}]@{offset}: {reason}{extra}; "
            f"set bad_records: dead_letter to route such records to the dead-letter table"
        )


class RangeReadError(OffsetFlowError):
    """A partition could not be read up to the range's `until_offset`."""

    def __init__(self, topic: str, partition: int, from_offset: int, until_offset: int,
                 reached: int, reason: str) -> None:
        self.topic = topic
        self.partition = partition
        self.from_offset = from_offset
        self.until_offset = until_offset
        self.reached = reached
        super().__init__(
            f"could not read {topic}[{partition}] [{from_offset}, {until_offset}): "
            f"stopped at offset {reached}: {reason}"
        )


class FencedCommitError(OffsetFlowError):
    """The committed position moved since the batch was planned: this batch is stale
    (a zombie or a concurrent run) and must not commit. Nothing was written."""

    def __init__(self, batch_id: int, topic: str, partition: int, expected: int,
                 found: int | None, *, open_scheduled: bool = False) -> None:
        self.batch_id = batch_id
        self.topic = topic
        self.partition = partition
        self.expected = expected
        self.found = found
        # the pipeline's open scheduled batch is re-used by every plan: unless another
        # run of it committed, it fails this way forever, so say how to get out
        way_out = (f"nothing was written. Unless another run of this batch committed "
                   f"first, no run can commit it: abandon it (offsetflow abandon --batch-id "
                   f"{batch_id} --reason '...') and the next plan starts from the committed "
                   f"position") if open_scheduled else \
            "another run committed first, nothing was written"
        super().__init__(
            f"batch {batch_id} fenced on {topic}[{partition}]: expected committed position "
            f"{expected}, found {found}; {way_out}"
        )


class BatchStateError(OffsetFlowError):
    """A batch is in a state that forbids the requested action (e.g. running a failed batch)."""


class BatchNotFoundError(OffsetFlowError):
    """No batch with that id (for that pipeline) exists in the ledger."""


class StagingIncompleteError(OffsetFlowError):
    """The commit found fewer staged parts than the job produced; refusing to commit."""


class StagedRowsLostError(StagingIncompleteError):
    """A staged part holds fewer rows than its marker counts (its rows were lost, e.g. by a
    crash that emptied the unlogged stage). Nothing was committed; the parts named in
    `parts` (None: the whole stage) are dropped with their markers, so the next attempt
    re-stages them from Kafka."""

    def __init__(self, batch_id: int, parts: list[int] | None, detail: str) -> None:
        self.batch_id = batch_id
        self.parts = parts
        super().__init__(
            f"batch {batch_id}: {detail}; nothing was committed, the lost part(s) were "
            f"dropped and the next run re-stages them from Kafka")


class TaskFileLostError(StagedRowsLostError):
    """A Kafka sink part's task file (`offsetflow.sinks.kafka.taskfile`) is not the one its
    part marker names: missing, short, corrupt, or not a task file. Nothing of the batch is
    visible (its transaction is aborted); the part is dropped with its marker, so the next
    run writes it again from Kafka."""

    def __init__(self, batch_id: int, part: int, path: str, why: str,
                 more: Sequence[tuple[int, str, str]] = (), hint: str = "") -> None:
        """`more`: other parts' lost files (part, path, why), found by the same check, so
        one run drops them all; `hint`: the way out when re-staging alone would not do."""
        self.path = path
        lost = sorted([(part, path, why), *more])
        detail = (f"the task file of part {part} at {path} is not the one its marker names: "
                  f"{why}" if not more else
                  f"the task files of parts {[p for p, _f, _w in lost]} are not the ones "
                  f"their markers name: " + "; ".join(f"part {p} at {f}: {w}"
                                                      for p, f, w in lost))
        super().__init__(batch_id, [p for p, _f, _w in lost],
                         detail + (f"; {hint}" if hint else ""))


class TaskFileAccessError(OffsetFlowError):
    """The driver may not read a Kafka sink's task file (EACCES/EPERM: the executors wrote
    it as a user whose file mode does not let the driver's user read it). Not a lost part:
    written again under the same settings it would be as unreadable, so nothing is dropped
    (files and markers are kept) and every run fails this way until the driver may read
    them or the settings a file is written with change (then the next run writes those
    parts again: `written_otherwise`); the message names the file, its owner and mode, the
    driver's user and the way out."""

    def __init__(self, batch_id: int, path: str, detail: str, way_out: str) -> None:
        self.batch_id = batch_id
        self.path = path
        super().__init__(
            f"batch {batch_id}: the driver may not read the task file {path}: {detail}; "
            f"nothing was committed and the task files are kept (they are not lost: "
            f"written again under the same settings they would be as unreadable). "
            f"{way_out}")


class IcebergTableReplacedError(StagedRowsLostError):
    """The Iceberg table was dropped and created again under the same name (another table
    UUID) after the batch's tasks wrote their data files for it: those files have the old
    table's field ids and location and are never committed into the new table. Nothing was
    committed; their parts are dropped with their markers, so the next run writes them for
    the table as it is then."""

    def __init__(self, batch_id: int, parts: list[int], table: str, written_for: str,
                 current: str) -> None:
        self.batch_id = batch_id
        self.parts = parts
        self.table = table
        self.written_for = written_for
        self.current = current
        StagingIncompleteError.__init__(
            self,
            f"batch {batch_id}: the Iceberg table {table} was replaced (dropped and created "
            f"again) after the batch's tasks wrote their data files: part(s) {parts} wrote "
            f"them for table UUID {written_for}, the table is now UUID {current}. Nothing "
            f"was committed; those parts were dropped, and the next run writes them into "
            f"the table as it is then. If the new table is a mistake, restore the old one "
            f"before re-running the batch: drop the new one (no purge) and register the "
            f"old one's newest metadata file (<its location>/metadata/*.metadata.json with "
            f"table-uuid {written_for}) under {table}")


class IcebergTableIdentityError(OffsetFlowError):
    """The Iceberg table the sink finds is not the table its ledger's batches live in: the
    ledger records the table's identity (table-uuid, location, catalog, identifier, the
    metadata of its last commit), and the table found has another one, or none (dropped,
    renamed, replaced, registered from older metadata, rolled back past the ledger's last
    batch, another catalog, namespace or table name). Nothing was written; the message
    names the table, the ledger's record, what was found and the ways out: restore the
    ledger's table (register its metadata file with the catalog again, or put the config
    back), or `offsetflow adopt-table`, which records the table found as the pipeline's
    and says which history stays behind."""

    def __init__(self, table: str, recorded: str, found: str, way_out: str) -> None:
        self.table = table
        self.recorded = recorded
        self.found = found
        super().__init__(f"Iceberg table {table} is not the table the ledger's batches live "
                         f"in: the ledger records {recorded}; found {found}. Nothing was "
                         f"written. {way_out}")


class StaleConfigError(BatchStateError):
    """The batch's recorded config changed while this run worked on it (another run took a
    new config with --accept-config-change and rebuilt the stage): this run's commit would
    mix two configs' output, so it commits nothing. Re-run with the batch's current config."""


class StaleStageError(BatchStateError):
    """This run's staging layout is outdated: another run rebuilt the batch's stage since
    (a changed split or config, a transform run starting over), so this run is a zombie and
    stages or commits nothing. Its parts would be numbered the old way."""

    def __init__(self, batch_id: int, mine: int | None, current: int) -> None:
        self.batch_id = batch_id
        super().__init__(
            f"batch {batch_id}: this run stages under stage generation {mine}, but another "
            f"run rebuilt the stage since (generation {current}); this run is stale and "
            f"writes nothing. Re-run the batch if it is not running elsewhere")


class IcebergBatchOpenError(BatchStateError):
    """An Iceberg upsert replay/backfill found another batch that the table holds (its
    snapshot committed) but the ledger does not (its driver died between the two commits):
    that batch's deletions are not remembered yet, so deciding now could bring a deleted key
    back. Run that batch (it finds its snapshot and completes), then this one again."""


class CommitLockTimeoutError(OffsetFlowError):
    """The commit waited too long for a lock another session holds (often a driver that died
    without closing its connection). Names the batch and the holder."""


class SchemaMismatchError(OffsetFlowError):
    """The existing target table cannot hold the batch's columns."""


class SchemaEvolutionError(OffsetFlowError):
    """A batch under `format.schema_evolution` holds a schema change it must not apply: an
    incompatible one (a type narrowed, a required field removed, a field added without a
    default), or under `fail` any change that adds a column. Raised after the ranges are
    read and before anything is committed (positions unmoved); the message names the
    topic, both schema ids with their versions, the first offset of the new schema and the
    way out. Every retry of the batch stops the same way until the way out is taken."""


class RequestError(OffsetFlowError):
    """A backfill or replay request (form, conf or CLI) is invalid; nothing was started."""


class KafkaUnavailableError(OffsetFlowError):
    """Kafka metadata could not be fetched (broker down, unknown topic)."""


class SchemaRegistryError(OffsetFlowError):
    """The schema registry of an avro pipeline did not answer (down, slow, a 5xx) or refused
    the request (credentials, a pinned reader version it lacks). Raised before a record is
    decoded with a schema it could not get, so nothing of the batch is committed and the
    next run reads the same ranges; the message names the registry (its URL without
    credentials), what was asked and the way out."""

    def __init__(self, url: str, what: str, reason: str, retriable: bool = True) -> None:
        self.url = url
        self.what = what
        self.reason = reason
        self.retriable = retriable
        way_out = ("the batch was not committed; run it again once the registry answers "
                   "(the retry reads the same ranges)" if retriable else
                   "fix format.schema_registry (url, credentials, reader_version); the batch "
                   "was not committed")
        super().__init__(f"schema registry {url}: {what}: {reason}; {way_out}")


class KafkaAuthError(OffsetFlowError):
    """The brokers refused the client's credentials (SASL, OAUTHBEARER): names where the
    settings come from (the Airflow connection, or kafka.client). Not retried: asking again
    with the same password cannot succeed."""


class SparkUnavailableError(OffsetFlowError):
    """The Spark Connect server a pipeline with `spark.launch: connect` names is not there."""


class LockTimeoutError(OffsetFlowError):
    """Another planner holds the pipeline's planning lock for too long."""


def summarize(items: Sequence[str], limit: int = 5) -> str:
    """Join the first `limit` items and say how many were left out."""
    head = ", ".join(items[:limit])
    return head + (f" … (+{len(items) - limit} more)" if len(items) > limit else "")


class WaitError(OffsetFlowError):
    """Waiting for new data of a pipeline stopped on an error that polling again will not fix
    (a broken pipeline config, a missing topic); the message says which."""


class KafkaSinkError(OffsetFlowError):
    """The Kafka topic sink could not commit a batch's transaction (fenced by a newer run,
    a producer error, an unknown outcome); names the batch, topic and transactional.id.
    Nothing of the batch is visible to read_committed consumers unless it says so."""


class OutputSchemaIncompatibleError(OffsetFlowError):
    """The schema registry refused the Kafka sink's Avro value schema (sink.value_format:
    avro) as incompatible with its subject's latest version. Raised before anything is
    produced; names the subject, both schemas and the ways out. Not retried: the same
    schema is refused again."""

    def __init__(self, url: str, subject: str, latest: str, ours: str) -> None:
        self.subject = subject
        super().__init__(
            f"schema registry {url}: subject {subject!r} refuses the sink's value schema as "
            f"incompatible with its latest version ({latest}); the schema offered: {ours}. "
            f"Nothing was produced and the batch was not committed. Ways out: make the "
            f"columns compatible (add fields as nullable, do not change a field's type), or "
            f"write to a new subject (sink.value_subject), or give the schema explicitly "
            f"(sink.value_schema), or change the subject's compatibility level in the "
            f"registry")


class LedgerIdentityError(BatchStateError):
    """The ledger's identity (`offsetflow.ledger.identity`) was made in another database:
    a copy of a ledger (staging from a prod dump) must get its own (`offsetflow db
    new-identity`), the same ledger restored or moved keeps it (`offsetflow db
    adopt-identity`). Names both databases."""


class LedgerVersionError(OffsetFlowError):
    """The ledger was migrated by a newer OffsetFlow than the one running (a rollback after
    `offsetflow db upgrade`): run that version or a newer one."""


class MissingExtraError(OffsetFlowError):
    """A pipeline uses an optional part of OffsetFlow (an extra of the package: `avro`,
    `iceberg`, `quality`; `offsetflow.extras`) whose library is not installed; names the
    pipeline's file and setting, the library and the extra that brings it."""

    def __init__(self, needed_by: str, module: str, extra: str, cause: str = "") -> None:
        self.needed_by = needed_by
        self.module = module
        self.extra = extra
        super().__init__(
            f"{needed_by} needs {module}, which this Python cannot import"
            f"{f' ({cause})' if cause else ''}: install OffsetFlow's {extra} extra into "
            f"this environment, pip install 'offsetflow[{extra}]' -c requirements.txt "
            f"(the constraints file of the tested versions, docs/deployment.md), or "
            f"'offsetflow[all]' for every optional part")


class WindowIncarnationError(OffsetFlowError):
    """A replay or backfill window's coordinates hold rows of a source topic incarnation
    the ledger does not know, beside another incarnation's (the topic was deleted and
    recreated): replacing them could delete another incarnation's rows, keeping them
    could duplicate this one's. Nothing is written; names the rows' batches and the way
    out."""


class AuditStateError(OffsetFlowError):
    """An audited window (`offsetflow audit`) is in a state that forbids the action: publish
    of a discarded audit, publish before the diff was made, a shadow or live table gone.
    Names the audit, its state and the way out."""


class AuditConflictError(AuditStateError):
    """Publish refused: the live rows at the audited window's coordinates, or the shadow's
    rows, changed since the diff the operator saw (another replay or backfill committed
    there, a hand edit); the way out is a fresh diff (`offsetflow audit show --refresh`),
    then publish again."""


# the OS errors of a write the file system cannot take (read-only, full, over quota or the
# file size limit, no permission, a path that is not a directory): a task's write (a Kafka
# sink's task file, an Iceberg data file) reports them as the sink's `TaskReportedError`
# naming the way out; a missing file (ENOENT: a read) is not one of them
NOT_WRITABLE_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES,
                                 errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EFBIG})


class TaskReportedError(OffsetFlowError):
    """Base of the errors a Spark task reports to the driver in its stats row instead of
    failing: Spark would retry the task and log the traceback of every attempt, and the
    driver would get it wrapped in Spark's exception. The driver raises it once
    (`reported_error`). Its only argument is its message."""


class WarehouseWriteError(TaskReportedError):
    """The Iceberg warehouse cannot be written (read-only, full, no permission): names the
    batch, the warehouse path, the OS error, that nothing was committed, and the way out."""


class TaskFileWriteError(TaskReportedError):
    """A Kafka sink task cannot write its task file (the directory full, read-only, not
    writable by the tasks' user): names the batch, the part, the directory, the OS error,
    that nothing was committed, and the ways out (room there, another directory, or
    `sink.task_files: off`)."""


class IcebergLayoutError(TaskReportedError):
    """An Iceberg table's partition spec cannot be computed by this runtime (a transform
    pyiceberg needs pyiceberg-core for), on the driver or on a Spark worker: every batch
    would fail; names the table, the field and the way out."""


def reported_error(kind: str, message: str) -> OffsetFlowError:
    """The `TaskReportedError` a task reported as (class name, message)."""
    for cls in TaskReportedError.__subclasses__():
        if cls.__name__ == kind:
            return cls(message)
    return TaskReportedError(message)
