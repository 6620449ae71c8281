"""`offsetflow validate FILE...` and `offsetflow schema`: a pipeline file checked offline (no
service, no Airflow, no ledger), every error of every file in one run, each at its line and
column; and the JSON Schema editors check a file with as it is typed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from offsetflow.config import check_file, pipeline_json_schema
from offsetflow.errors import ConfigError

SUFFIXES = (".yaml", ".yml")


def pipeline_files(path: Path) -> list[Path]:
    """The files a path names: itself, or a folder's *.yaml / *.yml files."""
    if not path.is_dir():
        return [path]
    return sorted(f for f in path.iterdir() if f.suffix in SUFFIXES and f.is_file())


def problem_line(e: ConfigError, severity: str) -> str:
    """`file:line:column: severity: field: message`, the form editors and CI logs link."""
    where = e.source if e.line is None else f"{e.source}:{e.line}:{e.column}"
    return f"{where}: {severity}: {e.field}: {e.message}"


def _position(item: tuple[ConfigError, str]) -> tuple[int, int]:
    return item[0].line or 0, item[0].column or 0


def cmd_validate(args: argparse.Namespace) -> int:
    n_files = n_errors = n_warnings = bad = 0
    for path in map(Path, args.files):
        files = pipeline_files(path)
        if not files:
            print(f"{path}: error: <file>: no pipeline file (*.yaml, *.yml) in this folder")
            n_files, n_errors, bad = n_files + 1, n_errors + 1, bad + 1
        for f in files:
            checked = check_file(f, strict_env=args.env_strict, duplicate_keys=True)
            found = [(e, "error") for e in checked.errors] + [(w, "warning")
                                                              for w in checked.warnings]
            for e, severity in sorted(found, key=_position):
                print(problem_line(e, severity))
            n_files += 1
            n_errors += len(checked.errors)
            n_warnings += len(checked.warnings)
            bad += bool(checked.errors)
    print(summary(n_files, bad, n_errors, n_warnings))
    return 2 if n_errors else 0


def summary(files: int, bad: int, errors: int, warnings: int) -> str:
    def n(count: int, what: str) -> str:
        return f"{count} {what}{'' if count == 1 else 's'}"

    notes = f" ({n(warnings, 'warning')})" if warnings else ""
    if errors:
        return (f"{bad} of {n(files, 'file')} invalid: {n(errors, 'error')}"
                + (f", {n(warnings, 'warning')}" if warnings else ""))
    return f"{n(files, 'file')} valid{notes}"


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(pipeline_json_schema(), indent=2))
    return 0
