"""`offsetflow` command line: plan, run, status, db upgrade, operator tools, and offline
checks of pipeline files (validate, schema).

Errors OffsetFlow raises on purpose are printed once, without a traceback, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from offsetflow.cli.common import dsn_of, pipeline_of
from offsetflow.cli.console import setup_logging
from offsetflow.cli.repair import (
    cmd_abandon,
    cmd_adopt_table,
    cmd_cleanup,
    cmd_complete,
    cmd_reset_position,
)
from offsetflow.cli.validate import cmd_schema, cmd_validate
from offsetflow.errors import ConfigError, OffsetFlowError
from offsetflow.ledger import Ledger

log = logging.getLogger(__name__)


def cmd_db_identity(args: argparse.Namespace) -> int:
    """`db new-identity` (a copy of a ledger) or `db adopt-identity` (the same ledger
    restored or moved): see `offsetflow.ledger.identity`."""
    from offsetflow.ledger import adopt_identity, new_identity

    with Ledger(dsn_of(args)) as ledger, ledger.transaction() as cur:
        if args.db_cmd == "new-identity":
            print(f"ledger identity is now {new_identity(cur)} (a ledger of its own)")
        else:
            print(f"ledger identity {adopt_identity(cur)} kept in this database")
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    with Ledger(dsn_of(args)) as ledger:
        applied = ledger.upgrade()
    print(f"ledger schema up to date ({len(applied)} migration(s) applied"
          + (f": {', '.join(applied)}" if applied else "") + ")")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from offsetflow.ops import plan_only

    cfg = pipeline_of(args)
    out = plan_only(cfg, dsn_of(args, cfg), started_by=args.started_by)
    if out.batch is None:
        print(f"pipeline {cfg.name}: nothing new to read")
        return 0
    b = out.batch
    print(f"pipeline {cfg.name}: batch {b.batch_id} ({'re-used' if out.reused else 'new'}, "
          f"{b.status})")
    for r in b.ranges:
        print(f"  {r}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from offsetflow.cli.console import progress_line
    from offsetflow.ops import CycleResult, run_until_caught_up

    cfg = pipeline_of(args)
    t = time.monotonic()

    def show(res: CycleResult) -> None:
        batch = res.plan.batch
        print(progress_line(res.summary(), list(batch.ranges) if batch else [], cfg.name),
              flush=True)

    results = run_until_caught_up(cfg, dsn_of(args, cfg), max_batches=args.max_batches,
                                  started_by=args.started_by, on_cycle=show)
    done = [r.summary() for r in results if r.report is not None]
    print(f"pipeline {cfg.name}: {len(done)} batch(es), "
          f"{sum(s.get('rows_written', 0) for s in done):,} rows written, "
          f"{sum(s.get('bad_records', 0) for s in done):,} dead letters in "
          f"{time.monotonic() - t:.1f}s" + (f"; full log: {args.log_path}"
                                              if args.log_path else ""))
    return 0


def parse_batch_ids(values: Sequence[str]) -> list[int]:
    """Batch ids as given on a command line or rendered from an XCom: "5", "5,6", "[5, 6]"."""
    ids = [int(x) for v in values for x in re.findall(r"-?\d+", v)]
    if not ids or any(i <= 0 for i in ids):
        raise ConfigError("command line", "--batch-id", f"no valid batch id in {list(values)}")
    return ids


def cmd_run_batch(args: argparse.Namespace) -> int:
    from offsetflow.job import build_spark, committed_report, run_batch

    cfg = pipeline_of(args)
    ids = parse_batch_ids(args.batch_id)
    dsn = dsn_of(args, cfg)
    spark = None
    spark_start_s = 0.0
    for bid in ids:  # in order: window batches are consecutive
        # a retry of a batch that committed needs no Spark session (a JVM and its workers)
        rep = committed_report(cfg, bid, dsn)
        if rep is None:
            if spark is None:
                t = time.monotonic()
                spark = build_spark(cfg, f"offsetflow-{cfg.name}-{ids[0]}")
                spark_start_s = round(time.monotonic() - t, 3)
            rep = run_batch(spark, cfg, bid, dsn, accept_config_change=args.accept_config_change)
        print(rep.result.message, flush=True)
        # one machine-readable line per batch, so a cold run's JVM start can be told apart
        log.info("batch %d timings %s", bid,
                 json.dumps({"spark_start_s": spark_start_s, **rep.timings}))
        spark_start_s = 0.0
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from offsetflow.ops import format_status, pipeline_status

    cfg = pipeline_of(args)
    st = pipeline_status(cfg, dsn_of(args, cfg), recent=args.recent)
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 0


SHIM = '''"""Airflow DAG (scheduled) of include/pipelines/{name}.yaml. One thin file per pipeline,
so a broken config shows up as this file's import error and hides no other pipeline's DAG.
Create one for a new pipeline with `offsetflow dags sync`."""

from offsetflow.orchestration.dags import pipeline_dag_for_file

dag = pipeline_dag_for_file(__file__)
'''


def cmd_dags_sync(args: argparse.Namespace) -> int:
    """Write the thin DAG file of every pipeline that has none; remove orphans."""
    from offsetflow.config import pipeline_dags_folder, pipelines_dir

    names = {p.stem for p in pipelines_dir().glob("*.yaml")}
    dags = Path(args.dags_dir) if args.dags_dir else pipeline_dags_folder()
    dags.mkdir(exist_ok=True)
    for name in sorted(names):
        f = dags / f"{name}.py"
        if not f.exists():
            f.write_text(SHIM.format(name=name))
            print(f"created {f}")
    for f in sorted(dags.glob("*.py")):
        if f.stem not in names and "pipeline_dag_for_file" in f.read_text():
            f.unlink()
            print(f"removed {f} (no pipeline {f.stem})")
    return 0


def window_conf(args: argparse.Namespace) -> dict[str, object]:
    """A backfill/replay command line as the DAG run conf (and the request) it becomes."""
    conf: dict[str, object] = {"pipeline": args.pipeline}
    for k in ("topic", "partitions", "from_offset", "until_offset", "from_timestamp",
              "until_timestamp", "records_per_batch", "target_table"):
        v = getattr(args, k, None)
        if v is not None:
            conf[k] = v
    if args.dry_run:
        conf["dry_run"] = True
    if args.allow_duplicates:
        conf["allow_duplicates"] = True
    if getattr(args, "audit", False):
        conf["audit"] = True
    return conf


def cmd_window(args: argparse.Namespace) -> int:
    """Backfill/replay: trigger the Airflow DAG through its REST API (default), or run
    here with --local."""
    conf = window_conf(args)
    kind = args.command
    if not args.local:
        from offsetflow.cli.airflow_api import connect
        from offsetflow.plan import parse_request

        parse_request(kind, conf)  # refuse bad input before anything starts
        api = connect(args.airflow_url)
        run = api.trigger(f"offsetflow_{kind}", conf)
        print(f"triggered offsetflow_{kind} run {run.get('dag_run_id')} on {api.url} with "
              f"conf {json.dumps(conf)}", flush=True)
        if run.get("is_paused"):
            print(f"note: DAG offsetflow_{kind} is paused; the run starts once it is "
                  f"unpaused", flush=True)
        return 0
    from offsetflow.ops import run_batches
    from offsetflow.orchestration.tasks import window_task

    planned = window_task(kind, conf, started_by=f"cli:{kind}",
                          load=lambda name: pipeline_of(argparse.Namespace(pipeline=name)))
    print(json.dumps(planned["report"], indent=2))
    if planned["batch_ids"]:
        cfg = pipeline_of(args)
        for rep in run_batches(cfg, dsn_of(args, cfg), planned["batch_ids"]):
            print(rep.result.message)
        if args.audit:
            from offsetflow.ops import format_audit, show_audit

            print(format_audit(show_audit(cfg, dsn_of(args, cfg), planned["batch_ids"][0],
                                          by=f"cli:{kind}")))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """`audit show|publish|discard BATCH`: an audited window (`offsetflow.ops.audit`)."""
    from offsetflow.ops import (
        audit_pipeline,
        discard_audit,
        format_audit,
        publish_audit,
        show_audit,
    )

    dsn = dsn_of(args)
    cfg = pipeline_of(args if args.pipeline or args.pipeline_file else argparse.Namespace(
        pipeline=audit_pipeline(dsn, args.audit_id)))
    by = args.by
    if args.audit_cmd == "show":
        out = show_audit(cfg, dsn, args.audit_id, by=by, refresh=args.refresh)
        print(json.dumps(out, indent=2, default=str) if args.json else format_audit(out))
        return 0
    if args.audit_cmd == "publish":
        res = publish_audit(cfg, dsn, args.audit_id, by=by, reason=args.reason,
                            max_changes=args.if_within)
        print(f"audit {res['audit_id']}: " + (
            f"published {res['rows']} rows into {res['target_table']}" if res["changed"]
            else "already published; nothing to do"))
        if res["changed"]:
            publish_events(args, cfg, res)
        return 0
    res = discard_audit(cfg, dsn, args.audit_id, by=by, reason=args.reason)
    print(f"audit {res['audit_id']}: " + ("discarded (shadow dropped, live table untouched)"
                                          if res["changed"] else "already discarded"))
    return 0


def publish_events(args: argparse.Namespace, cfg: Any, res: dict[str, Any]) -> None:
    """After a publish that changed something: the target's Asset event through Airflow's
    REST API (with --airflow-url or OFFSETFLOW_AIRFLOW_URL) and the OpenLineage event (when
    a transport is configured). Best effort: the publish has committed; what could not be
    sent is said on stderr."""
    import os

    from offsetflow.cli.airflow_api import connect
    from offsetflow.orchestration.audit_events import report_publish

    api, why = None, None
    if args.airflow_url or os.environ.get("OFFSETFLOW_AIRFLOW_URL"):
        try:
            api = connect(args.airflow_url)
        except OffsetFlowError as e:
            why = str(e)
    else:
        why = "no --airflow-url (nor OFFSETFLOW_AIRFLOW_URL) given"
    for note in report_publish(cfg, res, api, no_asset=why):
        print(f"audit {res['audit_id']}: {note}",
              file=sys.stderr if "not sent" in note else sys.stdout)


def version() -> str:
    """The installed distribution's version, else the package's own (a checkout on
    PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("offsetflow")
    except PackageNotFoundError:
        from offsetflow import __version__

        return __version__


def cmd_completion(args: argparse.Namespace) -> int:
    """The shell's completion script (argcomplete, which Airflow installs too)."""
    import argcomplete

    print(argcomplete.shellcode(["offsetflow"], shell=args.shell))
    return 0


STARTED_BY = "who started it, recorded on the batch in the ledger (default: cli)"
REASON = "why, recorded in the ledger beside the operator action"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offsetflow", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                   help="print the version and exit")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="-v: INFO logs on the console too, -vv: DEBUG")
    p.add_argument("--log-file", type=Path,
                   help="full log (default $OFFSETFLOW_LOG_FILE, else "
                        "$XDG_STATE_HOME/offsetflow/offsetflow.log)")
    p.add_argument("--dsn", help="PostgreSQL DSN (default: sink.connection / OFFSETFLOW_PG_DSN)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_pipeline(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = sp.add_mutually_exclusive_group(required=True)
        g.add_argument("--pipeline", "-p", help="pipeline name in include/pipelines")
        g.add_argument("--pipeline-file", help="path of a pipeline YAML")
        return sp

    db = sub.add_parser("db", help="ledger schema").add_subparsers(dest="db_cmd", required=True)
    db.add_parser("upgrade", help="apply ledger migrations").set_defaults(fn=cmd_db_upgrade)
    db.add_parser("new-identity", help="a copied ledger: give it an identity of its own"
                  ).set_defaults(fn=cmd_db_identity)
    db.add_parser("adopt-identity", help="a restored or moved ledger: keep its identity here"
                  ).set_defaults(fn=cmd_db_identity)

    sp = with_pipeline(sub.add_parser("plan", help="plan the next batch (or show the open one)"))
    sp.add_argument("--started-by", default="cli", help=STARTED_BY)
    sp.set_defaults(fn=cmd_plan)

    sp = with_pipeline(sub.add_parser("run", help="plan + Spark + commit until caught up"))
    sp.add_argument("--max-batches", type=int, default=1,
                    help="batches to run at most (default 1)")
    sp.add_argument("--started-by", default="cli", help=STARTED_BY)
    sp.set_defaults(fn=cmd_run)

    sp = with_pipeline(sub.add_parser("run-batch", help="read, stage and commit a planned batch"))
    sp.add_argument("--batch-id", action="append", required=True,
                    help="batch id(s); repeat or give '5,6' / '[5, 6]' to run in order")
    sp.add_argument("--accept-config-change", action="store_true",
                    help="run although the pipeline's output settings changed since the "
                         "batch was planned (its rows are written the new way)")
    sp.set_defaults(fn=cmd_run_batch)

    sp = with_pipeline(sub.add_parser("status", help="lag per partition, recent batches"))
    sp.add_argument("--json", action="store_true", help="print the status as JSON")
    sp.add_argument("--recent", type=int, default=10,
                    help="recent batches to show (default 10)")
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("abandon", help="close an open batch for good")
    sp.add_argument("--pipeline", help="its pipeline (default: the batch's, found by name)")
    sp.add_argument("--pipeline-file", help="path of its pipeline YAML (instead of --pipeline)")
    sp.add_argument("--batch-id", type=int, required=True, help="the open batch to abandon")
    sp.add_argument("--reason", required=True, help=REASON)
    sp.add_argument("--unchecked", action="store_true",
                    help="abandon even when the pipeline's config is not found, without "
                         "asking its sink whether it holds the batch (PostgreSQL sinks only)")
    sp.set_defaults(fn=cmd_abandon)

    sp = sub.add_parser("complete", help="complete an open batch from its external sink's "
                                         "record (its stage and Kafka records are gone)")
    sp.add_argument("--pipeline", help="its pipeline (default: the batch's, found by name)")
    sp.add_argument("--pipeline-file", help="path of its pipeline YAML (instead of --pipeline)")
    sp.add_argument("--batch-id", type=int, required=True, help="the open batch to complete")
    sp.add_argument("--reason", required=True, help=REASON)
    sp.set_defaults(fn=cmd_complete)

    sp = with_pipeline(sub.add_parser("reset-position", help="operator override of a position"))
    sp.add_argument("--topic", required=True, help="the topic whose position moves")
    g = sp.add_mutually_exclusive_group(required=True)
    g.add_argument("--partition", type=int, help="the partition whose position moves")
    g.add_argument("--all-partitions", action="store_true",
                   help="every partition the topic has in Kafka or in the ledger")
    sp.add_argument("--offset", type=int, required=True,
                    help="the new position: the next offset to read")
    sp.add_argument("--archive-to", metavar="TABLE",
                    help="move sink rows at or beyond the new position to TABLE (else they "
                         "refuse the reset)")
    sp.add_argument("--allow-duplicates", action="store_true",
                    help="Kafka sink: move a position back although the live output topic "
                         "already holds those records (they are written there again)")
    sp.add_argument("--force", action="store_true",
                    help="Iceberg sink: reset although the table holds rows at or beyond the "
                         "new position (the records read again are appended beside them)")
    sp.add_argument("--reason", required=True, help=REASON)
    sp.set_defaults(fn=cmd_reset_position)

    sp = with_pipeline(sub.add_parser(
        "adopt-table", help="Iceberg sink: record the table now found as the one the "
                            "pipeline's batches live in (it was replaced, moved or renamed "
                            "on purpose); the batches committed before stay in the old one"))
    sp.add_argument("--target-table", help="a backfill's target table (default: sink.table)")
    sp.add_argument("--reason", required=True, help=REASON)
    sp.set_defaults(fn=cmd_adopt_table)

    sp = sub.add_parser("cleanup", help="drop staged data of closed batches")
    sp.add_argument("--task-files", metavar="DIR",
                    help="a Kafka sink's sink.task_files directory: also remove the task "
                         "files of this ledger's batches that are not open (a killed "
                         "task's, or left when the driver died after the commit)")
    sp.set_defaults(fn=cmd_cleanup)

    dg = sub.add_parser("dags", help="DAG files").add_subparsers(dest="dags_cmd", required=True)
    sp = dg.add_parser("sync", help="write the thin DAG file of every pipeline")
    sp.add_argument("--dags-dir", default=None,
                    help="where the DAG files go (default: [offsetflow] pipeline_dags_folder, "
                         "i.e. <Airflow's dags_folder>/pipelines)")
    sp.set_defaults(fn=cmd_dags_sync)

    for kind, help_ in (("backfill", "re-read a window into the sink or a side table"),
                        ("replay", "re-process a committed range, replacing its rows")):
        sp = sub.add_parser(kind, help=help_)
        sp.add_argument("--pipeline", "-p", required=True, help="pipeline name")
        sp.add_argument("--topic", help="the topic to re-read (default: every topic)")
        sp.add_argument("--partitions", help="comma-separated; default all")
        sp.add_argument("--from-offset", type=int,
                        help="first offset of the window (with --until-offset)")
        sp.add_argument("--until-offset", type=int,
                        help="end of the window, exclusive")
        sp.add_argument("--from-timestamp", help="start of the window by time: ISO-8601 with "
                                                 "zone (instead of --from-offset)")
        sp.add_argument("--until-timestamp", help="end of the window by time, exclusive: "
                                                  "ISO-8601 with zone")
        sp.add_argument("--records-per-batch", type=int,
                        help="split the window into batches of at most this many records")
        if kind == "backfill":
            sp.add_argument("--target-table",
                            help="write into this table instead of the sink's own")
        sp.add_argument("--dry-run", action="store_true",
                        help="show the batches it would plan; plan and write nothing")
        sp.add_argument("--allow-duplicates", action="store_true",
                        help="write the window again into a Kafka sink's replay_topic that "
                             "an earlier replay or backfill already wrote it to")
        sp.add_argument("--audit", action="store_true",
                        help="write the window beside the live data (a shadow table, an "
                             "Iceberg branch), diff it, and publish or discard it later "
                             "(`offsetflow audit`); PostgreSQL and Iceberg sinks in append "
                             "mode")
        sp.add_argument("--local", action="store_true",
                        help="run here instead of triggering the Airflow DAG")
        sp.add_argument("--airflow-url",
                        help="Airflow's API server to trigger the DAG run on (default: "
                             "OFFSETFLOW_AIRFLOW_URL, else Airflow's [api] base_url); "
                             "credentials from OFFSETFLOW_AIRFLOW_TOKEN, or "
                             "OFFSETFLOW_AIRFLOW_USERNAME and OFFSETFLOW_AIRFLOW_PASSWORD")
        sp.set_defaults(fn=cmd_window)

    au = sub.add_parser("audit", help="an audited replay/backfill: show its diff, publish or "
                                      "discard it").add_subparsers(dest="audit_cmd",
                                                                   required=True)
    for verb, help_ in (("show", "the diff against the live table and the quality results"),
                        ("publish", "replace the live window by the audited one, atomically"),
                        ("discard", "drop the shadow; the live table stays as it is")):
        sp = au.add_parser(verb, help=help_)
        sp.add_argument("audit_id", type=int, metavar="BATCH",
                        help="the audit id (the window's first batch id) or any batch of it")
        sp.add_argument("--by", default="cli", help="who, recorded in the audit's history")
        sp.add_argument("--pipeline", help="its pipeline (default: the audit's, found by name)")
        sp.add_argument("--pipeline-file", help="path of its pipeline YAML")
        if verb == "show":
            sp.add_argument("--refresh", action="store_true",
                            help="diff again against the live table as it is now")
            sp.add_argument("--json", action="store_true", help="print it as JSON")
        else:
            sp.add_argument("--reason", help=REASON)
        if verb == "publish":
            sp.add_argument("--airflow-url",
                            help="Airflow's API server to send the target table's Asset "
                                 "event to (default: OFFSETFLOW_AIRFLOW_URL; credentials as "
                                 "for backfill); without it no Asset event is sent")
            sp.add_argument("--if-within", type=int, metavar="N",
                            help="publish only if the diff adds, removes and changes at most "
                                 "N rows in all and the quality suite (if any) passed; else "
                                 "refuse (exit 2) and leave the audit for a human")
        sp.set_defaults(fn=cmd_audit)

    sp = sub.add_parser(
        "validate", help="check pipeline files offline: every error, with line and column",
        description="Check pipeline files without touching any service: every error of "
                    "every file, as FILE:LINE:COLUMN: error: FIELD: MESSAGE, then a summary. "
                    "Exit 0 when all are valid (warnings allowed), 2 when any has an error.")
    sp.add_argument("files", nargs="+", metavar="FILE",
                    help="a pipeline YAML, or a folder of them (its *.yaml and *.yml)")
    sp.add_argument("--env-strict", action="store_true",
                    help="an unset ${VAR} without a default is an error (default: a warning: "
                         "the file is fine, the variable is the deployment's)")
    sp.set_defaults(fn=cmd_validate, offline=True)

    sp = sub.add_parser(
        "schema", help="print the JSON Schema of a pipeline file, for editors",
        description="Print the JSON Schema (draft 2020-12) of a pipeline YAML: "
                    "`offsetflow schema > pipeline.schema.json`, then start a pipeline file "
                    "with `# yaml-language-server: $schema=pipeline.schema.json` (VS Code's "
                    "YAML extension).")
    sp.set_defaults(fn=cmd_schema, offline=True)

    sp = sub.add_parser(
        "completion", help="print the shell completion script",
        description="Print the completion script of a shell; load it with "
                    "`eval \"$(offsetflow completion bash)\"` (in ~/.bashrc, or ~/.zshrc "
                    "with zsh).")
    sp.add_argument("shell", choices=("bash", "zsh", "fish"), help="the shell")
    sp.set_defaults(fn=cmd_completion, offline=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        import argcomplete
    except ImportError:  # completion is a convenience; the commands work without it
        pass
    else:
        argcomplete.autocomplete(parser)  # answers a completion request (and exits) only
    args = parser.parse_args(argv)
    if getattr(args, "offline", False):  # no log file, no database driver: nothing to reach
        try:
            return int(args.fn(args))
        except OffsetFlowError as e:
            print(f"offsetflow: error: {e}", file=sys.stderr)
            return 2
    # run-batch is what Airflow spark-submits: its console is the task log, which keeps INFO
    args.log_path = setup_logging(args.verbose, args.log_file,
                                  detailed=args.command == "run-batch")
    import psycopg2

    try:
        return int(args.fn(args))
    except OffsetFlowError as e:
        print(f"offsetflow: error: {e}", file=sys.stderr)
        return 2
    except psycopg2.OperationalError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"offsetflow: error: PostgreSQL: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
