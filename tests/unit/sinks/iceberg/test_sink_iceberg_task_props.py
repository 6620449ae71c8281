"""What the Iceberg task-side writer ships to Spark tasks: object-store settings yes, the
catalog's own connection (the SQL catalog's database URI carries its password) no, and
nothing of them in a repr that an error or a log line could print."""

from __future__ import annotations

from offsetflow.sinks.iceberg import TaskFiles
from offsetflow.sinks.iceberg.tasks import task_io_properties


def test_the_catalog_connection_stays_on_the_driver() -> None:
    props = {"uri": "postgresql+psycopg2://u:s3cret@db/lake", "warehouse": "file:///w",
             "s3.secret-access-key": "k", "credential": "c:d", "token": "t",
             "jdbc.password": "p", "py-io-impl": "pyiceberg.io.pyarrow.PyArrowFileIO"}
    assert task_io_properties(props) == {
        "warehouse": "file:///w", "s3.secret-access-key": "k",
        "py-io-impl": "pyiceberg.io.pyarrow.PyArrowFileIO"}


def test_task_files_repr_shows_no_io_property() -> None:
    tf = TaskFiles(1, "ns.t", "{}", {"s3.secret-access-key": "s3cret-value"}, "ofb-", 1, False)
    assert "s3cret-value" not in repr(tf)
