"""An append-mode commit that starts while the batch is still being read.

The commit's single INSERT of the whole stage is serial in one PostgreSQL backend (one core
busy, the rest idle while the driver waits). `PartwiseCommit` runs the protocol's one
sequence of steps (`offsetflow.commit.protocol.commit_steps`) in one transaction on a
connection of its own, being that sequence's `Step4`: step 4 moves each part into the target
as soon as its task has staged it, while later parts are still read, so most of it runs
before step 2's checks and step 3 (which still decide: any refusal rolls it all back):
  a. step 1's lock first (a second run of the batch waits here instead of racing it part by
     part), the config checked, the stage's layout read (fixed while the batch row is held);
     replay/backfill deletes what its ranges produced before (the start of step 4). The
     stage is not locked in SHARE mode: the tasks still write it;
  b. while tasks run: each part whose marker is visible is moved from its part table into
     the target, its marker checked against the layout and its rowcount against the
     marker (step 4 and step 2's checks, part by part). A marker commits with its task's
     COPY, so a failed task attempt moves nothing and a retried part is moved once;
  c. `finish()`: step 2's layout check of every marker, the parts left and any rows staged
     into the stage table itself, step 2's count of parts (and of rows: all were moved),
     step 3, the tasks' dead letters, steps 5-6; COMMIT. `abort()` (or any error) rolls
     back everything, moved parts included; a part that lost rows is dropped with its
     marker after the rollback, so the next run re-stages it.
Append only: an upsert keeps the latest record per key across the whole batch, so it waits
for all parts; a quality gate checks the whole stage before anything moves.

A sink outside PostgreSQL that takes parts as they come (`spec.external`, a `PartwiseSink`:
the Kafka topic sink) runs the same sequence: in b each newly visible part's marker is
checked against the layout and handed to the sink (`take_parts`), which writes what it may
into its still-uncommitted transaction (`begin_parts` first: its fencing and its look for
the batch's own record); in c the stage is held in SHARE mode and counted as `WholeStage`
does, and step 4 after step 3 is the sink's `find`/`write` as for any external sink, which
writes what is left and commits there. Any failure or `abort()` closes the sink, which
leaves nothing of it visible.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from offsetflow.commit.protocol import Step4, check_fence, commit_external, commit_steps
from offsetflow.commit.rows import append_part, delete_range_rows, move_stage_dead_letters
from offsetflow.commit.spec import CommitResult, CommitSpec, Moved, PartwiseSink
from offsetflow.errors import FencedCommitError, StagedRowsLostError
from offsetflow.ledger import Batch, Ledger, stage_part_table, stage_table
from offsetflow.stage import Marker, Packing, check_markers, layout_of, lock_stage

log = logging.getLogger(__name__)


class _Aborted(Exception):
    """The run failed before the commit could finish; roll the moved parts back."""


class PartwiseCommit(Step4):
    """See the module docstring. `parts`: how many part tables the stage has. Its thread
    runs the protocol's steps (`commit_steps`) with this object as their step 4."""

    POLL_S = 0.05  # `poll_s`'s default

    def __init__(self, dsn: str, batch: Batch, *, columns: list[str] | tuple[str, ...],
                 parts: int, dead_letter_table: str | None, timings: dict[str, float],
                 spec: CommitSpec | None = None) -> None:
        self.dsn = dsn
        self.batch = batch
        self.spec = spec or CommitSpec(columns=tuple(columns),
                                       dead_letter_table=dead_letter_table,
                                       bad_records_staged=dead_letter_table is not None)
        self.parts = parts
        self.timings = timings
        external = self.spec.external
        if external is not None and not isinstance(external, PartwiseSink):
            raise TypeError(f"{type(external).__name__} cannot take a batch part by part")
        self.external: PartwiseSink | None = external
        # a PostgreSQL target: each part's rows are checked against its marker as it
        # moves; an external sink: the stage is counted against its markers, as
        # `WholeStage` does (the sink counts what it wrote against them too), unless the
        # tasks wrote task files instead of the stage (`spec.task_files`, as `WholeStage`)
        self.scan = external is not None and not self.spec.task_files
        # during the read, the wait between two looks for newly staged parts: read before
        # each wait, so a new value holds from the next one; `waiting_s` is the wait the
        # commit is in (a caller that lengthened `poll_s` sees when no pass is left to run)
        self.poll_s = self.POLL_S
        self.waiting_s = 0.0
        self._moved_parts: set[int] = set()
        self._moved = Moved()  # step 4's counts, part by part
        self._finishing = 0.0  # when the last pass (c) began
        self._layout: tuple[int, Packing | None] | None = None
        self._finish = threading.Event()
        self._aborted = False
        self._expected_parts = 0
        self._result: CommitResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"offsetflow-commit-b{batch.batch_id}")

    def __enter__(self) -> PartwiseCommit:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._thread.is_alive():
            self.abort()
        if exc_type is not None and self._error is not None:
            log.warning("batch %d: the commit had failed too: %s: %s", self.batch.batch_id,
                        type(self._error).__name__, str(self._error)[:500])

    def abort(self) -> None:
        self._aborted = True
        self._finish.set()
        self._thread.join()

    def finish(self, expected_parts: int, staged_at: datetime | None = None) -> CommitResult:
        """`staged_at`: when the last part was staged, kept with the batch's timings."""
        self._expected_parts = expected_parts
        self.staged_at = staged_at
        self._finish.set()
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None  # shown once, by the caller
            raise error
        assert self._result is not None
        return self._result

    def _run(self) -> None:
        """The protocol's one sequence (`commit_steps`), with this object as its step 4."""
        bid = self.batch.batch_id
        try:
            with Ledger(self.dsn) as ledger:
                self._result = commit_steps(ledger, bid, self.spec, self, self.timings)
        except _Aborted:
            log.info("batch %d: commit aborted; the parts moved so far are rolled back", bid)
        except psycopg2.errors.UniqueViolation as e:
            self._error = self._fenced_or(e)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by finish()
            # (StagedRowsLostError: `commit_steps` dropped the part with its marker)
            self._error = e
        finally:
            if self.external is not None:  # committed, or nothing of it is visible
                self.external.close()

    # -- Step4: what this commit does between the protocol's steps ------------------------
    def skip(self, cur: psycopg2.extensions.cursor, batch: Batch) -> None:
        """Committed already (by another run): nothing moves, but the read goes on until
        `finish()` (or `abort()`)."""
        self._wait_for_finish(cur, None)

    def before_checks(self, cur: psycopg2.extensions.cursor, batch: Batch) -> None:
        """a and b: the batch row is held from here to COMMIT, so no run can adopt a config
        (checked just before) nor rebuild the stage meanwhile: the layout is fixed until
        COMMIT. No SHARE lock on the stage (`WholeStage`'s): each part is moved by its
        marker, its rowcount checked, while the tasks still write later ones."""
        self._layout = layout_of(cur, batch, self.spec.stage_generation,
                                 self.spec.subrange_parts)
        if self.external is not None:  # a: its fence, before anything is written there
            self.external.begin_parts(cur, batch, self._layout[1])
        elif batch.kind in ("replay", "backfill"):  # a
            delete_range_rows(cur, batch, self.spec)
        self._wait_for_finish(cur, self._moved)  # b
        # c: finish() comes after the last task committed, so this pass sees all
        self._finishing = time.monotonic()

    def before_count(self, cur: psycopg2.extensions.cursor, batch: Batch) -> None:
        """c: the parts left (all markers are of the layout: `check_layout`), and rows an
        earlier attempt staged into the stage table itself. An external sink: the stage
        held as `WholeStage` holds it (no late writer between the count and step 4); its
        `write` takes what is left."""
        if self.external is not None:
            lock_stage(cur, batch.batch_id)
            return
        self._move_staged_parts(cur, self._moved, "commit_insert_s")
        self._move_stage_itself(cur, self._moved)
        self.timings["commit_insert_s"] = round(time.monotonic() - self._finishing, 3)

    @property
    def expected_parts(self) -> int:
        return self._expected_parts

    def after_count(self, batch: Batch, staged: int) -> None:
        """Step 2's count against what was moved (every part was checked as it moved); an
        external sink counts what it wrote itself, in `write`."""
        if self.external is not None:
            return
        moved = self._moved
        if moved.rows + moved.dead != staged:
            raise StagedRowsLostError(batch.batch_id, None, f"{moved.rows + moved.dead} rows "
                                                            f"were moved but the markers count "
                                                            f"{staged}")

    def move(self, cur: psycopg2.extensions.cursor, batch: Batch, staged: int,
             per_range: dict[str, int]) -> Moved:
        """The end of step 4 after step 3: the tasks' dead letters. The counts per range
        are the moved parts' markers'. An external sink: its `find`, else its `write` of
        what is left, and its commit there."""
        if self.external is not None:
            moved = commit_external(cur, batch, self.external, staged)
            moved.per_range = per_range
            self.timings.update(moved.timings)
            return moved
        move_stage_dead_letters(cur, batch, self.spec, self._moved)  # end of 4
        return self._moved

    def _wait_for_finish(self, cur: psycopg2.extensions.cursor, moved: Moved | None) -> None:
        """Until `finish()`: each part whose marker is visible is moved (`moved`; None: none
        is). After `abort()`: `_Aborted`, which rolls back everything moved."""
        while not self._finish.is_set():  # b
            if moved is not None:
                self._move_staged_parts(cur, moved, "commit_overlapped_s")
            self.waiting_s = self.poll_s
            self._finish.wait(self.waiting_s)
        if self._aborted:
            raise _Aborted

    def _fenced_or(self, e: psycopg2.errors.UniqueViolation) -> BaseException:
        """A part's rows already in the target: if positions moved meanwhile, another run
        committed these ranges first and this one is fenced; else the rows came from
        elsewhere, and the unique violation is the error to show."""
        try:
            with Ledger(self.dsn) as ledger, ledger.transaction() as cur:
                check_fence(cur, self.batch)
        except FencedCommitError as fenced:
            fenced.__cause__ = e
            return fenced
        except psycopg2.Error:
            pass
        return e

    def _move_staged_parts(self, cur: psycopg2.extensions.cursor, moved: Moved,
                           timing: str) -> None:
        cur.execute("""SELECT part, rows_staged, per_partition, generation, subranges
                         FROM offsetflow.staged_parts
                        WHERE batch_id = %s AND kind = 'rows' AND NOT (part = ANY(%s))
                          AND part < %s ORDER BY part""",
                    (self.batch.batch_id, sorted(self._moved_parts), self.parts))
        found = cur.fetchall()
        if self.external is not None:
            t = time.monotonic()
            markers = [Marker("rows", part, generation, per_tp, subranges)
                       for part, _n, per_tp, generation, subranges in found]
            assert self._layout is not None
            check_markers(self.batch.batch_id, markers, *self._layout)
            self.external.take_parts(cur, self.batch, markers)  # called on every poll
            self._moved_parts.update(m.part for m in markers)
            if markers:
                self.timings[timing] = round(self.timings.get(timing, 0.0)
                                             + time.monotonic() - t, 3)
            return
        for part, rows_staged, per_tp, generation, subranges in found:
            assert self._layout is not None
            # a part of another layout is never moved (nor locked: its retry may drop it)
            check_markers(self.batch.batch_id,
                          [Marker("rows", part, generation, per_tp, subranges)],
                          *self._layout)
            t = time.monotonic()
            table = stage_part_table(self.batch.batch_id, part)
            append_part(cur, self.batch, self.spec, sql.SQL("ONLY {}").format(table),
                        int(rows_staged), f"part {part} ({table.as_string(cur)})", part,
                        moved)
            _add_per_range(moved, per_tp)
            self._moved_parts.add(part)
            self.timings[timing] = round(self.timings.get(timing, 0.0) + time.monotonic() - t,
                                         3)

    def _move_stage_itself(self, cur: psycopg2.extensions.cursor, moved: Moved) -> None:
        """Parts an earlier attempt staged into the stage table itself (numbered beyond
        the part tables): moved together, checked against their markers together."""
        cur.execute("""SELECT part, rows_staged, per_partition FROM offsetflow.staged_parts
                        WHERE batch_id = %s AND kind = 'rows' AND part >= %s""",
                    (self.batch.batch_id, self.parts))
        found = cur.fetchall()
        append_part(cur, self.batch, self.spec, sql.SQL("ONLY {}").format(
            stage_table(self.batch.batch_id)), sum(int(n) for _, n, _ in found),
            "the stage table", None, moved)
        for _, _, per_tp in found:
            _add_per_range(moved, per_tp)


def _add_per_range(moved: Moved, per_tp: dict[str, list[int]] | None) -> None:
    for tp, (n, _lo, _hi) in (per_tp or {}).items():
        moved.per_range[tp] = moved.per_range.get(tp, 0) + int(n)
