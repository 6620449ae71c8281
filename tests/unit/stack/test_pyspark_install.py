"""The install must leave one consistent pyspark: the Spark provider pulls pyspark-client,
which overwrites part of pyspark's files with another version unless both are pinned."""

from importlib import metadata
from pathlib import Path

import pyspark


def test_pyspark_and_pyspark_client_agree() -> None:
    version = pyspark.__version__
    assert version.startswith("4."), version
    assert metadata.version("pyspark") == version
    try:
        client = metadata.version("pyspark-client")
    except metadata.PackageNotFoundError:
        client = version
    assert client == version, f"pyspark {version} but pyspark-client {client}"
    jars = Path(pyspark.__file__).parent / "jars"
    core = sorted(p.name for p in jars.glob("spark-core_*.jar"))
    assert core and core[0].endswith(f"-{version}.jar"), core
