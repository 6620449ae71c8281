"""Data-quality gate: a Great Expectations suite run on a batch before it commits.

The suite runs inside the Spark job's driver, between staging and the commit, on the staged
rows in PostgreSQL: exactly the batch's data, with no second read of Kafka. Suites live in
the GX project under `include/gx` (`expectations/<suite>.json`), created and edited with
GX's own API. Results go to the ledger (`batches.quality`), the task log, and GX Data Docs.

Row-level expectations report the source coordinates of the rows that failed, so the
`dead_letter` policy can route exactly those rows and commit the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offsetflow.errors import OffsetFlowError

log = logging.getLogger(__name__)

GX_ROOT = Path(__file__).resolve().parents[2] / "include"
GX_URL_VAR = "OFFSETFLOW_GX_PG_URL"  # the connection string stays out of great_expectations.yml
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


def gx_root() -> Path:
    return Path(os.environ.get("OFFSETFLOW_GX_ROOT") or GX_ROOT)


def validate_stage(dsn: str, batch_id: int, suite_name: str, root: Path | None = None,
                   build_docs: bool = True) -> QualityResult:
    """Run the suite on the staged rows of `batch_id`."""
    import great_expectations as gx

    gx_root = root or globals()["gx_root"]()
    os.environ[GX_URL_VAR] = sqlalchemy_url(dsn)
    ctx = gx.get_context(mode="file", project_root_dir=str(gx_root))
    try:
        suite = ctx.suites.get(suite_name)
    except Exception as e:  # noqa: BLE001 - GX raises its own not-found types
        raise OffsetFlowError(f"quality suite {suite_name!r} not found in "
                              f"{gx_root / 'gx' / 'expectations'}: {e}") from e
    ds = ctx.data_sources.add_or_update_postgres("offsetflow_stage",
                                                 connection_string="${" + GX_URL_VAR + "}")
    asset_name = f"b{int(batch_id)}"
    with contextlib.suppress(Exception):  # not there yet
        ds.delete_asset(asset_name)
    asset = ds.add_table_asset(asset_name, table_name=f"b{int(batch_id)}",
                               schema_name="offsetflow_stage")
    batch_def = asset.add_batch_definition_whole_table("batch")
    # one name per attempt: a retried batch (its commit failed after the suite ran) must not
    # meet the definition an earlier attempt left behind ("Store already has the key")
    vd = gx.ValidationDefinition(
        name=f"offsetflow_{suite_name}_b{int(batch_id)}_{uuid.uuid4().hex[:8]}",
        data=batch_def, suite=suite)
    res = vd.run(result_format={"result_format": "COMPLETE",
                                "unexpected_index_column_names": ["topic", "partition",
                                                                  "offset"]})
    result = QualityResult(suite=suite_name, success=bool(res.success),
                           outcomes=outcomes_from_gx(res.results))
    if build_docs:
        try:
            ctx.build_data_docs()
            result.data_docs = str(gx_root / "gx" / "uncommitted" / "data_docs" / "local_site"
                                   / "index.html")
        except Exception as e:  # noqa: BLE001 - docs are a convenience, not the gate
            log.warning("could not build GX Data Docs: %s", e)
    with contextlib.suppress(Exception):  # per-batch definitions are not project files;
        ctx.validation_definitions.delete(vd.name)  # before the asset it refers to goes
    with contextlib.suppress(Exception):
        ds.delete_asset(asset_name)
    return result
