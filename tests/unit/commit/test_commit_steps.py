"""The commit protocol's one sequence of steps (`commit.protocol.commit_steps`), as
`commit_batch` (step 4 on the whole stage) and `PartwiseCommit` (step 4 part by part) run
it: which step comes when, with the database steps replaced by recorders. What each step
does in SQL is for the integration tests (test_commit_protocol.py, test_sink.py, ...)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import offsetflow.commit.partwise as partwise
import offsetflow.commit.protocol as protocol
from offsetflow.commit import CommitResult, CommitSpec, Moved, PartwiseCommit, commit_batch
from offsetflow.errors import StagedRowsLostError
from offsetflow.ledger import Batch
from offsetflow.ranges import OffsetRange

STAGED = 10


def batch(kind: str = "scheduled", status: str = "running") -> Batch:
    return Batch(7, "orders", kind, status, (OffsetRange("t", 0, 0, 20),), "events",
                 moves_positions=kind == "scheduled")


class FakeLedger:
    dsn = "fake"

    def __init__(self, calls: list[str], dsn: str = "fake") -> None:
        self.calls = calls
        self.conn = self

    def get_backend_pid(self) -> int:
        return 1

    def __enter__(self) -> FakeLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[str]:
        try:
            yield "cur"
        except BaseException:
            self.calls.append("rollback")
            raise
        self.calls.append("COMMIT")


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The protocol's database steps, recording their order into `calls`."""
    calls: list[str] = []
    state: dict[str, Any] = {"calls": calls, "batch": batch(), "staged": STAGED}

    def rec(name: str, result: Any = None) -> Any:
        def step(*args: Any, **kw: Any) -> Any:
            calls.append(name)
            return result() if callable(result) else result
        return step

    def check_staged(cur: Any, b: Batch, expected: int, scan: bool) -> tuple[int, dict]:
        calls.append(f"check_staged(expected={expected}, scan={scan})")
        return state["staged"], {"t/0": state["staged"]}

    def record_batch(cur: Any, ledger: Any, b: Batch, moved: Moved, staged: int,
                     timings: Any, staged_at: Any = None, readers: Any = None) -> CommitResult:
        calls.append("record_batch" if readers is None else f"record_batch(readers={readers})")
        return CommitResult(b.batch_id, "committed", moved.rows, moved.dead,
                            dict(moved.per_range))

    monkeypatch.setattr(protocol, "lock_errors", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(protocol, "lock_batch", rec("lock_batch", lambda: state["batch"]))
    monkeypatch.setattr(protocol, "check_config", rec("check_config"))
    monkeypatch.setattr(protocol, "evolve_target", rec("evolve_target", lambda: ["add c"]))
    monkeypatch.setattr(protocol, "lock_stage", rec("lock_stage"))
    monkeypatch.setattr(protocol, "check_layout", rec("check_layout"))
    monkeypatch.setattr(protocol, "check_staged", check_staged)
    monkeypatch.setattr(protocol, "fence_and_advance", rec("fence_and_advance"))
    monkeypatch.setattr(protocol, "move_rows", rec("move_rows", lambda: Moved(rows=STAGED)))
    monkeypatch.setattr(protocol, "commit_external",
                        rec("commit_external", lambda: Moved(rows=STAGED)))
    monkeypatch.setattr(protocol, "record_batch", record_batch)
    monkeypatch.setattr(protocol, "forget_parts", rec("forget_parts"))
    return state


def test_commit_batch_checks_everything_then_moves_the_whole_stage(
        steps: dict[str, Any]) -> None:
    result = commit_batch(FakeLedger(steps["calls"]), 7, expected_parts=3,  # type: ignore[arg-type]
                          spec=CommitSpec(columns=("a",)))
    assert steps["calls"] == ["lock_batch", "check_config", "lock_stage", "check_layout",
                              "check_staged(expected=3, scan=True)", "fence_and_advance",
                              "move_rows", "record_batch", "COMMIT"]
    assert result.records_per_range == {"t/0": STAGED}  # the markers' split


def test_schema_evolution_alters_the_target_first_in_the_commits_transaction(
        steps: dict[str, Any]) -> None:
    """format.schema_evolution: the evolved columns are added right after step 1, before
    any row moves, and the reader ids recorded at step 5, all before the one COMMIT."""
    commit_batch(FakeLedger(steps["calls"]), 7, expected_parts=3,  # type: ignore[arg-type]
                 spec=CommitSpec(columns=("a", "c"), add_columns=(("c", "text"),),
                                 readers={"t": 5}))
    assert steps["calls"] == ["lock_batch", "check_config", "evolve_target", "lock_stage",
                              "check_layout", "check_staged(expected=3, scan=True)",
                              "fence_and_advance", "move_rows",
                              "record_batch(readers={'t': 5})", "COMMIT"]


@pytest.mark.parametrize(("spec", "step4", "scan"), [
    (CommitSpec(columns=(), external=object()), "commit_external", True),  # type: ignore[arg-type]
    (CommitSpec(columns=(), external=object(), task_files=True),  # type: ignore[arg-type]
     "commit_external", False),  # the sink reconciles the task-written files
])
def test_an_external_sink_takes_step_4_in_the_same_sequence(
        steps: dict[str, Any], spec: CommitSpec, step4: str, scan: bool) -> None:
    steps["batch"] = batch("replay")  # moves no position: no step 3
    commit_batch(FakeLedger(steps["calls"]), 7, expected_parts=1, spec=spec)  # type: ignore[arg-type]
    assert steps["calls"] == ["lock_batch", "check_config", "lock_stage", "check_layout",
                              f"check_staged(expected=1, scan={scan})", step4,
                              "record_batch", "COMMIT"]


def test_a_committed_batch_is_left_alone(steps: dict[str, Any]) -> None:
    steps["batch"] = batch(status="committed")
    result = commit_batch(FakeLedger(steps["calls"]), 7, expected_parts=3,  # type: ignore[arg-type]
                          spec=CommitSpec(columns=()))
    assert result.status == "already_committed"
    assert steps["calls"] == ["lock_batch", "COMMIT"]


def test_a_stage_that_lost_rows_is_forgotten_after_the_rollback(
        steps: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def lost(*args: Any, **kw: Any) -> Any:
        raise StagedRowsLostError(7, [1], "part 1 lost rows")

    monkeypatch.setattr(protocol, "check_staged", lost)
    with pytest.raises(StagedRowsLostError):
        commit_batch(FakeLedger(steps["calls"]), 7, expected_parts=3,  # type: ignore[arg-type]
                     spec=CommitSpec(columns=()))
    assert steps["calls"] == ["lock_batch", "check_config", "lock_stage", "check_layout",
                              "rollback", "forget_parts"]


@pytest.fixture
def parts(steps: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`PartwiseCommit` on the fake ledger; its part moves are recorded (5 rows while the
    tasks read, 3 in the last pass, 2 staged into the stage table itself)."""
    calls = steps["calls"]
    monkeypatch.setattr(partwise, "Ledger", lambda dsn: FakeLedger(calls, dsn))
    monkeypatch.setattr(partwise, "layout_of", lambda *a: calls.append("layout_of") or (1, None))
    monkeypatch.setattr(partwise, "delete_range_rows", lambda *a: calls.append("delete_range"))
    monkeypatch.setattr(partwise, "move_stage_dead_letters",
                        lambda *a: calls.append("move_stage_dead_letters"))
    moves = {"commit_overlapped_s": 5, "commit_insert_s": 3}
    steps["moving"] = moving = threading.Event()

    def move_parts(self: PartwiseCommit, cur: Any, moved: Moved, timing: str) -> None:
        if not calls or calls[-1] != f"parts({timing})":  # once per polling stretch
            calls.append(f"parts({timing})")
        moved.rows += moves.pop(timing, 0)
        moved.per_range["t/0"] = moved.rows
        if timing == "commit_overlapped_s":
            moving.set()

    def move_stage_itself(self: PartwiseCommit, cur: Any, moved: Moved) -> None:
        calls.append("stage_itself")
        moved.rows += 2
        moved.per_range["t/0"] = moved.rows

    monkeypatch.setattr(PartwiseCommit, "_move_staged_parts", move_parts)
    monkeypatch.setattr(PartwiseCommit, "_move_stage_itself", move_stage_itself)
    monkeypatch.setattr(PartwiseCommit, "POLL_S", 0.001)
    return steps


def run_partwise(b: Batch, moving: threading.Event | None = None, abort: bool = False
                 ) -> CommitResult | None:
    """`moving`: finish only once a part was moved while the tasks read."""
    timings: dict[str, float] = {}
    with PartwiseCommit("fake", b, columns=("a",), parts=2, dead_letter_table=None,
                        timings=timings) as committer:
        if abort:
            committer.abort()
            return None
        assert moving is None or moving.wait(30)
        return committer.finish(expected_parts=2)


@pytest.mark.parametrize("kind", ["scheduled", "replay"])
def test_partwise_runs_the_same_sequence_moving_parts_before_the_checks(
        parts: dict[str, Any], kind: str) -> None:
    """Its differences, on purpose: no SHARE lock on the stage (tasks still write it), the
    parts moved before step 2's checks, the rows moved counted against the markers, step 3
    after the moves, then the tasks' dead letters."""
    parts["batch"] = batch(kind)
    result = run_partwise(parts["batch"], parts["moving"])
    assert result is not None and result.status == "committed"
    assert (result.rows_written, result.records_per_range) == (STAGED, {"t/0": STAGED})
    assert parts["calls"] == [
        "lock_batch", "check_config", "layout_of",
        *(["delete_range"] if kind == "replay" else []),
        "parts(commit_overlapped_s)", "check_layout", "parts(commit_insert_s)",
        "stage_itself", "check_staged(expected=2, scan=False)",
        *(["fence_and_advance"] if kind == "scheduled" else []),
        "move_stage_dead_letters", "record_batch", "COMMIT"]


def test_partwise_refuses_when_the_moved_rows_are_not_what_the_markers_count(
        parts: dict[str, Any]) -> None:
    parts["staged"] = STAGED + 1
    with pytest.raises(StagedRowsLostError, match="10 rows were moved but the markers count 11"):
        run_partwise(batch(), parts["moving"])
    assert parts["calls"][-4:] == ["stage_itself", "check_staged(expected=2, scan=False)",
                                   "rollback", "forget_parts"]  # no step 3, nothing recorded


def test_partwise_on_a_committed_batch_waits_for_the_read_and_moves_nothing(
        parts: dict[str, Any]) -> None:
    parts["batch"] = batch(status="committed")
    result = run_partwise(parts["batch"])
    assert result is not None and result.status == "already_committed"
    assert parts["calls"] == ["lock_batch", "COMMIT"]


def test_an_aborted_partwise_commit_rolls_back_what_it_moved(parts: dict[str, Any]) -> None:
    assert run_partwise(batch(), abort=True) is None
    assert "record_batch" not in parts["calls"] and parts["calls"][-1] == "rollback"
