"""The sweeps of task files (`sweep_task_files`: the driver's at the start of each run with
task files, `offsetflow cleanup --task-files`) with files in the directory that are not
task files of this ledger's batches."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import psycopg2


def test_a_stray_file_with_an_odd_batch_id_never_fails_a_sweep(
        pg_dsn: str, tmp_path: Path) -> None:
    """Files in the directory whose batch id is not ASCII digits (a superscript two, an
    Arabic-Indic three: `str.isdigit` takes both, `int` refuses the first and reads the
    second as 3) are not task files: no sweep fails on them (the driver's would fail every
    run of every pipeline using the directory) and none removes them as batch 3's."""
    from offsetflow.cli import main as cli
    from offsetflow.ledger import ledger_identity
    from offsetflow.sinks.kafka.pipeline import sweep_closed

    with contextlib.closing(psycopg2.connect(pg_dsn)) as conn, conn.cursor() as cur:
        ident = ledger_identity(cur).installation_id
    d = tmp_path / "shared"
    d.mkdir()
    odd = [d / f"{ident}_b\u00b2_p0_x.arrow", d / f"{ident}_b\u0663_p0_x.arrow"]
    for f in odd:
        f.write_bytes(b"not a task file")
    got: Any = sweep_closed(pg_dsn, str(d), 0)
    assert got == 0
    assert cli(["--dsn", pg_dsn, "cleanup", "--task-files", str(d)]) == 0
    assert all(f.exists() for f in odd)
