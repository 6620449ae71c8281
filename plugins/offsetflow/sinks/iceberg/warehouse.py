"""Writes to the Iceberg warehouse that fail because it cannot be written (read-only, full,
no permission): one `WarehouseWriteError` naming the batch, the warehouse path, the OS
error, that nothing was committed, and the way out, raised where the write failed (a
Spark task's data files, the driver's files and metadata at the catalog commit, a new
table's first metadata).

Nothing is half-committed by such a failure: data files and manifests are written before
the catalog commit, and a catalog commit writes its new metadata file before it moves the
table's pointer, so a failed write leaves only files no snapshot references (the batch's
own, swept after its retry commits, `sink_iceberg_files`); the ledger transaction rolls
back with it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from offsetflow.errors import NOT_WRITABLE_ERRNOS, WarehouseWriteError

# object stores' denials carry no errno, only their text (file systems: NOT_WRITABLE_ERRNOS)
_NOT_WRITABLE_TEXT = ("Read-only file system", "No space left", "Permission denied",
                      "Disk quota", "ACCESS_DENIED", "AccessDenied")


def not_writable(e: BaseException) -> bool:
    """Whether `e` says the warehouse cannot be written (pyarrow's file systems raise
    OSError with the errno set; object stores' denials carry no errno, only their text)."""
    if not isinstance(e, OSError):
        return False
    return e.errno in NOT_WRITABLE_ERRNOS or any(t in str(e) for t in _NOT_WRITABLE_TEXT)


def warehouse_error(e: OSError, location: str, what: str, batch_id: int | None
                    ) -> WarehouseWriteError:
    detail = " ".join(str(e).split())
    batch = f"batch {batch_id}: " if batch_id is not None else ""
    again = (f"run batch {batch_id} again (offsetflow run-batch --batch-id {batch_id}, or "
             f"the next scheduled run)" if batch_id is not None else "run again")
    return WarehouseWriteError(
        f"{batch}cannot write to the Iceberg warehouse at {location} ({what}): {detail}; "
        f"nothing was committed (the table and the ledger are as before). Make "
        f"it writable (free space, a read-write mount, write permission for this user) and "
        f"{again}: it commits once")


@contextlib.contextmanager
def writing_to(location: str, what: str, batch_id: int | None) -> Iterator[None]:
    """Raise a write the warehouse cannot take as `WarehouseWriteError` (one line, no
    chained traceback: its message carries the OS error)."""
    try:
        yield
    except OSError as e:
        if not not_writable(e):
            raise
        raise warehouse_error(e, location, what, batch_id) from None
