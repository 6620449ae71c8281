"""Data-quality gate: a Great Expectations suite run on a batch before it commits.

The suite runs inside the Spark job's driver, between staging and the commit, on the staged
rows in PostgreSQL: exactly the batch's data, with no second read of Kafka. Suites live in
the GX project under `include/gx` (`expectations/<suite>.json`), created and edited with
GX's own API; `configure_project` gives each suite a Checkpoint (Data Docs update as its
action) once, at set-up time, and a batch only runs it: no run edits the project config.
Results go to the ledger (`batches.quality`), the task log, and GX Data Docs.

Row-level expectations report the source coordinates of the rows that failed, so the
`dead_letter` policy can route exactly those rows and commit the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offsetflow.config import gx_root
from offsetflow.errors import OffsetFlowError
from offsetflow.extras import require

log = logging.getLogger(__name__)

DATASOURCE, ASSET, BATCH_DEFINITION = "offsetflow_batches", "staged_batch", "whole_batch"
LEGACY_DATASOURCE = "offsetflow_stage"  # per-batch table assets, added at run time before
COORDINATE_COLUMNS = ("topic", "partition", "offset")
Coordinate = tuple[str, int, int]


class QualityGateError(OffsetFlowError):
    """The batch broke its expectation suite and the policy is `fail`: nothing committed."""

    def __init__(self, batch_id: int, result: QualityResult) -> None:
        self.batch_id = batch_id
        self.result = result
        super().__init__(f"batch {batch_id} failed quality suite {result.suite!r}: "
                         f"{result.summary_text()}")


@dataclass
class ExpectationOutcome:
    expectation: str
    column: str | None
    success: bool
    unexpected_count: int | None
    element_count: int | None
    sample_values: list[Any]
    failing_rows: list[Coordinate] = field(default_factory=list)

    @property
    def row_level(self) -> bool:
        return self.column is not None and self.unexpected_count is not None


@dataclass
class QualityResult:
    suite: str
    success: bool
    outcomes: list[ExpectationOutcome]
    policy: str = "fail"
    routed_rows: int = 0
    data_docs: str | None = None

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]

    def failing_coordinates(self) -> dict[Coordinate, list[str]]:
        """Rows to route, with the expectations each broke; empty if any failure is not
        row-level (a table-level failure cannot be fixed by dropping rows)."""
        out: dict[Coordinate, list[str]] = {}
        for o in self.failed:
            if not o.row_level or (o.unexpected_count and not o.failing_rows):
                return {}
            for c in o.failing_rows:
                out.setdefault(c, []).append(f"{o.expectation}({o.column})")
        return out

    def summary_text(self) -> str:
        parts = []
        for o in self.failed:
            where = f" on {o.column}" if o.column else ""
            rows = f" {o.unexpected_count} of {o.element_count} rows" \
                if o.unexpected_count is not None else ""
            sample = f", e.g. {o.sample_values[:3]}" if o.sample_values else ""
            parts.append(f"{o.expectation}{where}:{rows}{sample}")
        return "; ".join(parts) or "all expectations met"

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite, "success": self.success, "policy": self.policy,
            "routed_rows": self.routed_rows, "data_docs": self.data_docs,
            "summary": self.summary_text(),
            "expectations": [{
                "expectation": o.expectation, "column": o.column, "success": o.success,
                "unexpected_count": o.unexpected_count, "element_count": o.element_count,
                "sample_values": [str(v) for v in o.sample_values[:10]],
                "failing_rows": len(o.failing_rows)} for o in self.outcomes],
        }


def outcomes_from_gx(results: Sequence[Any]) -> list[ExpectationOutcome]:
    """Translate GX ExpectationValidationResults into plain outcomes (no GX types kept)."""
    out = []
    for r in results:
        cfg = r.expectation_config
        res: Mapping[str, Any] = r.result or {}
        rows = []
        for item in res.get("unexpected_index_list") or []:
            if isinstance(item, Mapping) and {"topic", "partition", "offset"} <= set(item):
                rows.append((str(item["topic"]), int(item["partition"]), int(item["offset"])))
        out.append(ExpectationOutcome(
            expectation=cfg.type, column=cfg.kwargs.get("column"), success=bool(r.success),
            unexpected_count=res.get("unexpected_count"), element_count=res.get("element_count"),
            sample_values=list(res.get("partial_unexpected_list") or [])[:20],
            failing_rows=rows))
    return out


def sqlalchemy_url(dsn: str) -> str:
    """SQLAlchemy URL for a libpq DSN (URI or key=value form)."""
    from urllib.parse import quote

    from psycopg2.extensions import parse_dsn

    d = parse_dsn(dsn)
    auth = quote(d.get("user", ""), safe="")
    if d.get("password"):
        auth += ":" + quote(d["password"], safe="")
    host = d.get("host", "localhost") + (f":{d['port']}" if d.get("port") else "")
    return f"postgresql+psycopg2://{auth}@{host}/{quote(d.get('dbname', ''), safe='')}"


def checkpoint_name(suite_name: str) -> str:
    return f"offsetflow_{suite_name}"


def quiet_gx() -> None:
    """GX's INFO records (datasource saves, store set-up) are detail for the log file, not
    the console; its metric progress bars are switched off in the project config."""
    logging.getLogger("great_expectations").setLevel(logging.WARNING)


def configure_project(ctx: Any, suite_names: Sequence[str] | None = None) -> list[str]:
    """Set-up time, once per project (include/quality/create_suites.py): the dataframe
    datasource a batch is handed to, and per suite a ValidationDefinition and a Checkpoint
    whose actions update Data Docs. Run time only reads these (`validate_stage`), so two
    pipelines validating at once never write the project config. Idempotent; returns the
    checkpoint names."""
    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx.variables.progress_bars = ProgressBarsConfig(globally=False,
                                                     metric_calculations=False)
    ctx.variables.save()
    if LEGACY_DATASOURCE in ctx.data_sources.all():  # per-batch table assets of old runs
        ctx.data_sources.delete(LEGACY_DATASOURCE)
    try:
        ds = ctx.data_sources.get(DATASOURCE)
    except Exception:  # noqa: BLE001 - GX raises its own not-found types
        ds = ctx.data_sources.add_pandas(DATASOURCE)
    try:
        asset = ds.get_asset(ASSET)
    except Exception:  # noqa: BLE001
        asset = ds.add_dataframe_asset(ASSET)
    try:
        batch_def = asset.get_batch_definition(BATCH_DEFINITION)
    except Exception:  # noqa: BLE001
        batch_def = asset.add_batch_definition_whole_dataframe(BATCH_DEFINITION)
    names = list(suite_names) if suite_names is not None else [s.name for s in ctx.suites.all()]
    out = []
    for suite_name in names:
        suite = ctx.suites.get(suite_name)
        name = checkpoint_name(suite_name)
        vd = ctx.validation_definitions.add_or_update(
            gx.ValidationDefinition(name=name, data=batch_def, suite=suite))
        ctx.checkpoints.add_or_update(gx.Checkpoint(
            name=name, validation_definitions=[vd],
            actions=[UpdateDataDocsAction(name="update_data_docs")],
            result_format={"result_format": "COMPLETE",
                           "unexpected_index_column_names": list(COORDINATE_COLUMNS)}))
        out.append(name)
    return out


COLUMN_KWARGS = ("column", "column_A", "column_B", "column_list")
# types pandas cannot hash or compare as they come from psycopg2 (memoryview, dict, list)
TEXT_TYPES = {"bytea", "json", "jsonb", "ARRAY", "USER-DEFINED"}


def suite_columns(suite: Any) -> set[str] | None:
    """Columns the suite's expectations name, plus the source coordinates; None when one
    looks at the table as a whole (its column set), so every column must be read."""
    cols = set(COORDINATE_COLUMNS)
    for e in suite.expectations:
        cfg = e.configuration
        if cfg.type.startswith("expect_table_column"):
            return None
        for k in COLUMN_KWARGS:
            v = cfg.kwargs.get(k)
            cols.update([v] if isinstance(v, str) else v or [])
    return cols


def read_stage(dsn: str, batch_id: int, columns: set[str] | None = None) -> Any:
    """The staged rows of a batch as a pandas DataFrame (what the checkpoint validates):
    only `columns` when given (a column the table lacks is left out, so its expectation
    reports it missing), raw bytes and JSON as text."""
    import pandas as pd
    import psycopg2
    from psycopg2 import sql

    table = f"b{int(batch_id)}"
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT column_name, data_type FROM information_schema.columns WHERE "
                        "table_schema = 'offsetflow_stage' AND table_name = %s "
                        "ORDER BY ordinal_position", (table,))
            cols = [(c, t) for c, t in cur.fetchall() if columns is None or c in columns]
            if not cols:
                raise OffsetFlowError(f"batch {batch_id}: no staged table "
                                      f"offsetflow_stage.{table} to validate")
            select = sql.SQL(", ").join(
                sql.SQL("{}::text AS {}").format(sql.Identifier(c), sql.Identifier(c))
                if t in TEXT_TYPES else sql.Identifier(c) for c, t in cols)
            cur.execute(sql.SQL("SELECT {} FROM {}.{}").format(
                select, sql.Identifier("offsetflow_stage"), sql.Identifier(table)))
            return pd.DataFrame.from_records(cur.fetchall(), columns=[c for c, _ in cols])
    finally:
        conn.close()


def validate_stage(dsn: str, batch_id: int, suite_name: str, root: Path | None = None,
                   build_docs: bool = True) -> QualityResult:
    """Run the suite's Checkpoint on the staged rows of `batch_id`. Reads the project config
    and writes only results (validations, Data Docs) under `uncommitted/`."""
    quiet_gx()  # before the import: importing GX logs ~200 INFO lines
    gx = require("quality", f"quality.suite {suite_name!r}")

    project = root or gx_root()
    ctx = gx.get_context(mode="file", project_root_dir=str(project))
    try:
        checkpoint = ctx.checkpoints.get(checkpoint_name(suite_name))
    except Exception as e:  # noqa: BLE001 - GX raises its own not-found types
        raise OffsetFlowError(
            f"quality suite {suite_name!r} has no checkpoint {checkpoint_name(suite_name)!r} "
            f"in {project / 'gx'}: create the suite and run include/quality/create_suites.py "
            f"(or quality.configure_project) once: {e}") from e
    if not build_docs:
        checkpoint.actions = []  # this in-memory copy only; nothing is saved
    columns = suite_columns(checkpoint.validation_definitions[0].suite)
    res = checkpoint.run(batch_parameters={"dataframe": read_stage(dsn, batch_id, columns)})
    results = [r for vr in res.run_results.values() for r in vr.results]
    result = QualityResult(suite=suite_name, success=bool(res.success),
                           outcomes=outcomes_from_gx(results))
    docs = project / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html"
    if build_docs and docs.exists():
        result.data_docs = str(docs)
    return result
