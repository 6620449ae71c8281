"""OffsetFlow's optional parts (the extras of pyproject.toml) and the one import each goes
through: a pipeline that uses a part whose library is missing gets a `MissingExtraError`
naming the extra to install, where the library is first imported, not a ModuleNotFoundError
from deep inside a batch (or from a Spark task).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from offsetflow.errors import MissingExtraError

# extra -> the module whose import proves it installed (the extra's main library)
EXTRAS: dict[str, str] = {
    "avro": "fastavro",
    "iceberg": "pyiceberg",
    "quality": "great_expectations",
}


def require(extra: str, needed_by: str) -> ModuleType:
    """The extra's library, imported; `needed_by` names what asks for it (a pipeline and
    its setting: "orders.yaml: sink.type: iceberg (pipeline orders)")."""
    module = EXTRAS[extra]
    try:
        return importlib.import_module(module)
    except ImportError as e:  # not installed, or installed without what it imports
        missing = getattr(e, "name", None)
        cause = "" if missing == module else str(e)
        raise MissingExtraError(needed_by, module, extra, cause) from e
