"""The task files a batch's part markers name (a Kafka sink's, issue 32:
`offsetflow.sinks.kafka.taskfile`), dropped wherever the markers are: abandon, cleanup,
a config change, the commit's stage drop, a part dropped for re-staging. Here in the
ledger, not in the sink, because every one of those drops is the ledger's or the stage's,
and the marker is what says where the files are (the driver's switch may be off by then).

A marker's entry names one attempt's file (`path`, `attempt`); every attempt's file of that
part in that directory is dropped (the attempt is the name's last field, so its pattern
matches the part's other attempts and their temporary files, and nothing of another
ledger's or another batch's: the name starts with the ledger's installation id). An entry
without `attempt` and `crc32` is not a task file (an Iceberg data file: never touched).
Files of attempts whose part has no marker at all are dropped by the batch's commit
(`KafkaPipelineSink.after_commit`), not here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg2.extensions

log = logging.getLogger(__name__)


def drop_named_task_files(cur: psycopg2.extensions.cursor, batch_id: int,
                          parts: list[int] | None = None) -> int:
    """Drop every attempt's task file of the parts (None: all) whose markers name one;
    how many. Best effort (the markers go regardless): a file left is logged, never a
    failure of the drop, and a later drop or the commit's sweep takes it."""
    cur.execute("""SELECT data_files FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows' AND data_files IS NOT NULL
                      AND (%s::int[] IS NULL OR part = ANY(%s::int[]))""",
                (batch_id, parts, parts))
    n = 0
    for (entries,) in cur.fetchall():
        for e in entries or []:
            if not (isinstance(e, dict) and e.get("attempt") and "crc32" in e):
                continue
            path = Path(str(e["path"]))
            try:
                for f in path.parent.glob(path.name.replace(str(e["attempt"]), "*") + "*"):
                    f.unlink(missing_ok=True)
                    n += 1
            except OSError as err:
                log.warning("batch %d: task files beside %s were not dropped: %s", batch_id,
                            path, err)
    return n
