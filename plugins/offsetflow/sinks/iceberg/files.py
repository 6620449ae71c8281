"""The Iceberg sink's data files: how they are named and which of them may be deleted.

Every data file the sink writes for a batch starts with that batch's prefix
(`ofb-<tag>-<batch id>-`, `tag` from the pipeline and the batch's planned_at), through a
location provider set on the sink's in-memory view of the table only (never the stored
properties, so other writers are unaffected). After a retried batch committed, the sweep
deletes only unreferenced files carrying THAT prefix: files of its dead attempts, never a
concurrent writer's (a compaction in flight stays unreferenced until its commit, however
long it takes).

No sweep deletes a file that another table whose metadata lies in the table's metadata
folder references (`other_tables_files`): a table dropped without purge, with another one
created at its location, can be registered again from its metadata.

Paths are compared in one canonical form (`canonical_path`): a manifest may say
`file:/x`, `file:///x` or `/x` for the file a listing calls `/x`. A sweep that finds
referenced files but none of them in its listing refuses to delete anything: that is a
spelling it does not understand, not orphans.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from offsetflow.errors import OffsetFlowError

if TYPE_CHECKING:
    from pyiceberg.table import Table

    from offsetflow.ledger import Batch

log = logging.getLogger(__name__)

PROVIDER_PROPERTY = "write.py-location-provider.impl"
PREFIX_PROPERTY = "offsetflow.data-file-prefix"
PROVIDER = "offsetflow.sinks.iceberg.files.BatchFileLocations"


class OrphanSweepRefusedError(OffsetFlowError):
    """The sweep could not match the table's referenced files to its listing."""


def batch_file_prefix(batch: Batch) -> str:
    """The name prefix of the data files the sink writes for `batch` (stable across its
    attempts; another pipeline or another ledger's batch of the same id gets another)."""
    planned = batch.planned_at.isoformat() if batch.planned_at else ""
    tag = hashlib.sha256(f"{batch.pipeline}\0{planned}".encode()).hexdigest()[:10]
    return f"ofb-{tag}-{batch.batch_id}-"


def name_files_for(table: Table, prefix: str) -> None:
    """This in-memory view of `table` names its new data files `<prefix><name>`."""
    props = table.metadata.properties
    if props.get(PREFIX_PROPERTY) != prefix or props.get(PROVIDER_PROPERTY) != PROVIDER:
        table.metadata = table.metadata.model_copy(update={"properties": {
            **props, PROVIDER_PROPERTY: PROVIDER, PREFIX_PROPERTY: prefix}})


def _base_provider(table_location: str, props: dict[str, str]) -> Any:
    from pyiceberg.table.locations import load_location_provider

    return load_location_provider(table_location, {
        k: v for k, v in props.items() if k not in (PROVIDER_PROPERTY, PREFIX_PROPERTY)})


def _provider_class() -> type:
    from pyiceberg.table.locations import LocationProvider

    class BatchFileLocations(LocationProvider):
        """The table's usual location provider, with the batch's prefix on file names."""

        def __init__(self, table_location: str, table_properties: Any) -> None:
            super().__init__(table_location, table_properties)
            self._base = _base_provider(table_location, dict(table_properties))
            self._prefix = table_properties.get(PREFIX_PROPERTY, "")

        def new_data_location(self, data_file_name: str, partition_key: Any = None) -> str:
            return str(self._base.new_data_location(self._prefix + data_file_name,
                                                    partition_key))

    return BatchFileLocations


def __getattr__(name: str) -> Any:  # pyiceberg imports the provider class by name
    if name == "BatchFileLocations":
        cls = _provider_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def canonical_path(location: str) -> str:
    """A data file's location as the table's file system lists it: no scheme, `file:/x`,
    `file:///x` and `/x` all `/x`, `s3://b/k` `b/k`, `hdfs://nn/p` `/p`; normalised."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    return posixpath.normpath(PyArrowFileIO.parse_location(location)[2])


def referenced_files(table: Table) -> set[str]:
    """Canonical paths of every data file a snapshot of the table references (each
    manifest read once: a fast append keeps the earlier ones, so snapshots share them)."""
    return {canonical_path(p) for p in _data_file_paths(table, table.snapshots())}


def _data_file_paths(table: Table, snapshots: Iterable[Any],
                     take: Callable[[Any], bool] = lambda manifest: True) -> Iterator[str]:
    """The data file paths (as written) of the manifests of `snapshots` that `take`
    accepts, each manifest read once (snapshots of fast appends share them)."""
    io = table.io
    seen: set[str] = set()
    for snap in snapshots:
        for manifest in snap.manifests(io):
            if manifest.manifest_path in seen or not take(manifest):
                continue
            seen.add(manifest.manifest_path)
            for entry in manifest.fetch_manifest_entry(io, discard_deleted=False):
                yield entry.data_file.file_path


def _list_data_files(table: Table, dirs: Iterable[str] | None = None
                     ) -> tuple[Any, list[Any]]:
    """(file system, its file infos) of the `*.parquet` files under the table's data/
    (recursively), or with `dirs` (locations), directly in those folders."""
    from pyarrow import fs as pafs
    from pyiceberg.io.pyarrow import PyArrowFileIO

    scheme, netloc, root = PyArrowFileIO.parse_location(table.location().rstrip("/") + "/data")
    filesystem = PyArrowFileIO(dict(table.io.properties)).fs_by_scheme(scheme, netloc)
    selectors = ([pafs.FileSelector(root, recursive=True)] if dirs is None else
                 [pafs.FileSelector(PyArrowFileIO.parse_location(d)[2]) for d in sorted(dirs)])
    infos = []
    for selector in selectors:
        try:
            infos.extend(filesystem.get_file_info(selector))
        except FileNotFoundError:
            continue
    return filesystem, [i for i in infos
                        if i.type == pafs.FileType.File and i.path.endswith(".parquet")]


def other_tables_files(table: Table) -> set[str]:
    """Canonical paths of the data files that OTHER tables whose metadata lies in this
    table's metadata folder reference: a table dropped without purge and another created
    at its location (the default location of the same name), or the sink's table replaced
    and the new one adopted. The dropped one can be registered again from its metadata, so
    its files are not this table's orphans. Metadata files of this table (its table-uuid)
    are told apart by reading the head of each one its metadata log does not list.
    Raises OrphanSweepRefusedError when a metadata file cannot be read."""
    import re

    from pyarrow import fs as pafs
    from pyiceberg.io.pyarrow import PyArrowFileIO
    from pyiceberg.serializers import FromInputFile

    mine = str(table.metadata.table_uuid)
    folder = posixpath.dirname(str(table.metadata_location))
    own = {canonical_path(e.metadata_file) for e in table.metadata.metadata_log}
    own.add(canonical_path(str(table.metadata_location)))
    scheme, netloc, root = PyArrowFileIO.parse_location(folder)
    filesystem = PyArrowFileIO(dict(table.io.properties)).fs_by_scheme(scheme, netloc)
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(root))
    except FileNotFoundError:
        return set()
    uuid_re = re.compile(rb'"table-uuid"\s*:\s*"([0-9A-Fa-f-]{36})"')
    out: set[str] = set()
    seen: set[str] = set()
    for info in infos:
        path = posixpath.normpath(info.path)
        if info.type != pafs.FileType.File or not path.endswith(".metadata.json") or \
                path in own:
            continue
        location = _with_scheme(scheme, netloc, path)
        try:
            with filesystem.open_input_stream(info.path) as f:
                m = uuid_re.search(f.read(4096))
            if m is not None and m.group(1).decode().lower() == mine.lower():
                continue
            other = FromInputFile.table_metadata(table.io.new_input(location))
        except Exception as e:  # noqa: BLE001 - never guess: nothing is deleted
            raise OrphanSweepRefusedError(
                f"orphan sweep of {'.'.join(table.name())}: could not read {location} to "
                f"tell whether another table references files at its location ({e}); "
                f"nothing deleted") from e
        if str(other.table_uuid) == mine:
            continue
        for snap in other.snapshots:
            try:
                manifests = snap.manifests(table.io)
            except FileNotFoundError:  # its manifest list is gone: it cannot be read back
                log.warning("orphan sweep of %s: snapshot %d of table %s (metadata %s) "
                            "has lost its manifest list", ".".join(table.name()),
                            snap.snapshot_id, other.table_uuid, location)
                continue
            for manifest in manifests:
                if manifest.manifest_path in seen:
                    continue
                seen.add(manifest.manifest_path)
                for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
                    out.add(canonical_path(entry.data_file.file_path))
    if out:
        log.info("orphan sweep of %s: %d data files at its location belong to another "
                 "table (a dropped one's metadata lies there); kept", ".".join(table.name()),
                 len(out))
    return out


def _with_scheme(scheme: str, netloc: str, path: str) -> str:
    """A listed path as a location the table's FileIO opens."""
    if scheme in ("", "file"):
        return path
    if scheme in ("hdfs", "viewfs"):
        return f"{scheme}://{netloc}{path}"
    return f"{scheme}://{path}"  # object stores list bucket/key


def remove_orphan_files(table: Table, older_than_s: float, prefix: str | None = None,
                        keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Delete data files under the table's data folder that no snapshot references, older
    than `older_than_s` and, with `prefix`, whose name starts with it; never one another
    table at its location references (`other_tables_files`), nor one in `keep` (canonical
    paths: the open batches' files). Returns the removed paths. Raises
    OrphanSweepRefusedError when snapshots reference files but the listing holds none of
    them (a path spelling this code does not understand)."""
    referenced = referenced_files(table)
    filesystem, infos = _list_data_files(table)
    listed = {posixpath.normpath(i.path): i for i in infos}
    if referenced and infos and not referenced & listed.keys():
        raise OrphanSweepRefusedError(
            f"orphan sweep of {'.'.join(table.name())}: its snapshots reference "
            f"{len(referenced)} data files (e.g. {next(iter(referenced))}) but none of the "
            f"{len(infos)} files listed under {table.location()}/data (e.g. "
            f"{infos[0].path}); nothing deleted")
    cutoff = time.time() - older_than_s
    removed = []
    others: set[str] | None = None
    for path, info in listed.items():
        if path in referenced or path in keep:
            continue
        if prefix is not None and not posixpath.basename(path).startswith(prefix):
            continue
        if info.mtime is not None and info.mtime.timestamp() > cutoff:
            continue
        if others is None:  # read once, when a file would go
            others = other_tables_files(table)
        if path in others:
            continue
        filesystem.delete_file(info.path)
        removed.append(info.path)
    if removed:
        log.info("removed %d orphan data files of %s", len(removed), ".".join(table.name()))
    return removed


def remove_batch_orphans(table: Table, batch: Batch) -> list[str]:
    """After `batch` committed: delete the data files named with its prefix that its own
    snapshots did not add (files of task attempts that died or whose marker lost, of
    driver attempts that died before the catalog commit). Only the manifests its snapshots
    added are read, and after a batch's first run only the folders of the files it added
    are listed (an attempt of the same run read the same records under the same partition
    spec, so its files went to those folders); a batch that took more runs (a refused
    part rewritten under a new spec, a killed driver, a zombie run) lists the whole data
    folder. So a first run's sweep costs the listing of its partitions' folders, not of
    the table (an unpartitioned table has one folder: all of it). Raises
    OrphanSweepRefusedError when main holds no snapshot of the batch, or its files are not
    found in the listing (a spelling this code does not understand)."""
    from offsetflow.config import summary_batch

    snaps = {s.snapshot_id: s for s in table.snapshots()
             if summary_batch(s.summary.additional_properties if s.summary else {},
                              batch.pipeline, batch.batch_id) is not None}
    name = ".".join(table.name())
    if not snaps:
        raise OrphanSweepRefusedError(f"orphan sweep of batch {batch.batch_id} in {name}: no "
                                      f"snapshot of the batch; nothing deleted")
    added: set[str] = set()
    dirs: set[str] = set()
    for path in _data_file_paths(table, snaps.values(),
                                 lambda manifest: manifest.added_snapshot_id in snaps):
        added.add(canonical_path(path))
        dirs.add(posixpath.dirname(path))
    prefix = batch_file_prefix(batch)
    filesystem, infos = _list_data_files(table, dirs if batch.attempts <= 1 else None)
    mine = {posixpath.normpath(i.path): i for i in infos
            if posixpath.basename(i.path).startswith(prefix)}
    if added and mine and not added & mine.keys():
        raise OrphanSweepRefusedError(
            f"orphan sweep of batch {batch.batch_id} in {name}: none of the {len(added)} "
            f"files its snapshots added (e.g. {next(iter(added))}) is among the {len(mine)} "
            f"files listed with its prefix; nothing deleted")
    removed = [info.path for path, info in mine.items() if path not in added]
    if removed and batch.attempts > 1:
        # an earlier run may have committed the batch into a table replaced since (its
        # files carry the same prefix): that table's metadata may be registered again
        others = other_tables_files(table)
        removed = [p for p in removed if posixpath.normpath(p) not in others]
    for path in removed:
        filesystem.delete_file(path)
    if removed:
        log.info("batch %d: removed %d data files of attempts that did not commit from %s",
                 batch.batch_id, len(removed), name)
    return removed
