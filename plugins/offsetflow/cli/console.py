"""What a person at a terminal sees: one progress line per batch and a summary, while the
full logs (OffsetFlow, GX, Spark's Python side) go to a file.

Airflow task logs keep the detail: `run-batch` (what the DAGs spark-submit) logs INFO to
the console as before; the commands a person types log WARNING and up to the console
unless `-v` (INFO) or `-vv` (DEBUG) is given.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

LOG_FILE_VAR = "OFFSETFLOW_LOG_FILE"
SPARK_LOG4J_VAR = "OFFSETFLOW_SPARK_LOG4J"  # a log4j2 config for a Spark started here
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# libraries whose INFO is noise even in the file (py4j logs every JVM call, importing GX
# ~200 lines of its docs registry)
NOISY = ("py4j", "pyspark", "great_expectations")


def default_log_file() -> Path:
    """`$OFFSETFLOW_LOG_FILE`, else `$XDG_STATE_HOME/offsetflow/offsetflow.log`."""
    if os.environ.get(LOG_FILE_VAR):
        return Path(os.environ[LOG_FILE_VAR])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "offsetflow" / "offsetflow.log"


def console_level(verbose: int, detailed: bool = False) -> int:
    """WARNING for a person, INFO with -v or for the machine-facing commands, DEBUG -vv."""
    if verbose >= 2:
        return logging.DEBUG
    return logging.INFO if verbose == 1 or detailed else logging.WARNING


def setup_logging(verbose: int = 0, log_file: Path | None = None,
                  detailed: bool = False) -> Path | None:
    """Console at `console_level`, everything from INFO (DEBUG with -vv) into `log_file`.
    Returns the log file, or None when it cannot be opened (then the console gets INFO,
    so nothing is lost)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    level = console_level(verbose, detailed)
    path = log_file or default_log_file()
    file_handler: logging.Handler | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        level = min(level, logging.INFO)
    console = logging.StreamHandler()
    console.setLevel(level)
    console.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(console)
    file_level = logging.DEBUG if verbose >= 2 else logging.INFO
    if file_handler is not None:
        file_handler.setLevel(file_level)
        file_handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(file_handler)
    root.setLevel(min(level, file_level))
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if file_handler is None:
        return None
    if level > logging.INFO:  # Spark's JVM: its WARN lines to spark.log beside ours
        os.environ[SPARK_LOG4J_VAR] = str(write_spark_log4j(path.parent))
    return path


def write_spark_log4j(log_dir: Path) -> Path:
    """A log4j2 config for a local Spark driver: WARN and up into `log_dir/spark.log`, only
    ERROR on the console (the JVM's start-up notes are not a person's business)."""
    conf = log_dir / "spark-log4j2.properties"
    conf.write_text(f"""\
rootLogger.level = warn
rootLogger.appenderRef.file.ref = file
rootLogger.appenderRef.console.ref = console
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log_dir / "spark.log"}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{yyyy-MM-dd HH:mm:ss,SSS}} %p %c: %m%n%ex
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
appender.console.filter.threshold.type = ThresholdFilter
appender.console.filter.threshold.level = error
""")
    return conf


def _count(n: int) -> str:
    return f"{n:,}"


def progress_line(summary: dict[str, Any], ranges: list[Any] | None = None,
                  pipeline: str = "") -> str:
    """One line for a micro-batch: its ranges, records read, rows written, rate (offsets per
    second of the whole batch run) and commit time, from `CycleResult.summary()` and the
    batch's OffsetRanges."""
    who = f"pipeline {pipeline}: " if pipeline else ""
    if summary.get("batch_id") is None:
        return f"{who}caught up, nothing new to read"
    ranges = [r for r in ranges or [] if r.until_offset > r.from_offset]
    records = sum(r.until_offset - r.from_offset for r in ranges)
    shown = ", ".join(str(r) for r in ranges[:3]) + (
        f" +{len(ranges) - 3} more" if len(ranges) > 3 else "")
    secs = float(summary.get("total_s") or 0) or (
        float(summary.get("read_stage_s") or 0) + float(summary.get("commit_s") or 0))
    rate = f", {_count(int(records / secs))} rec/s" if secs > 0 and records else ""
    commit = f" in {summary['commit_s']:.2f}s" if summary.get("commit_s") is not None else ""
    dead = summary.get("bad_records") or 0
    return (f"{who}batch {summary['batch_id']} {summary.get('status')}{commit}: "
            f"{len(ranges)} range(s) {shown}; {_count(records)} offsets -> "
            f"{_count(summary.get('rows_written') or 0)} rows"
            + (f", {_count(dead)} dead letters" if dead else "") + rate)
