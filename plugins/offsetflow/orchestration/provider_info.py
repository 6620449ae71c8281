"""What Airflow's ProvidersManager learns about OffsetFlow (`airflow providers list`).

Declared as the `apache_airflow_provider` entry point in pyproject.toml. Modules are listed
only when they are part of this installation, so a partial build never names a class Airflow
cannot import; `package-name` must equal the distribution name (Airflow checks).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from offsetflow import __version__
from offsetflow.config import provider_config

INTEGRATION = "OffsetFlow"
PACKAGE = "offsetflow"
ORCHESTRATION = "offsetflow.orchestration"


LINEAGE = "offsetflow.orchestration.lineage"


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _modules(*names: str) -> list[str]:
    return [m for m in (f"{ORCHESTRATION}.{n}" for n in names) if _present(m)]


FOREIGN_CONN_TYPES = frozenset({"postgres", "kafka"})


def _connection_types() -> list[dict[str, str]]:
    """The hook's own connection type, when the hook declares one that no other provider
    owns: OffsetFlowHook reads `postgres` and `kafka` connections, and registering it for
    those types would replace the postgres/kafka providers' hooks in the connection form."""
    if not _present(f"{ORCHESTRATION}.hooks"):
        return []
    hooks = importlib.import_module(f"{ORCHESTRATION}.hooks")
    hook = getattr(hooks, "OffsetFlowHook", None)
    conn_type = getattr(hook, "conn_type", None)
    if hook is None or not conn_type or conn_type in FOREIGN_CONN_TYPES:
        return []
    return [{"connection-type": conn_type,
             "hook-class-name": f"{ORCHESTRATION}.hooks.OffsetFlowHook",
             "hook-name": getattr(hook, "hook_name", None) or INTEGRATION}]


# Asset URI schemes OffsetFlow's lineage uses, with the provider that owns each; OffsetFlow
# registers a handler and an OpenLineage converter only where that provider is not installed.
ASSET_SCHEMES = {
    "kafka": ("airflow.providers.apache.kafka", "kafka"),
    "postgres": ("airflow.providers.postgres", "postgres"),
}


def _asset_uris() -> list[dict[str, Any]]:
    out = []
    for scheme, (owner, fn) in ASSET_SCHEMES.items():
        if not _present(owner):
            out.append({"schemes": [scheme],
                        "handler": f"{LINEAGE}.sanitize_{fn}_uri",
                        "to_openlineage_converter": f"{LINEAGE}.{fn}_to_openlineage"})
    return out


def get_provider_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "package-name": PACKAGE,
        "name": INTEGRATION,
        "description": "Exactly-once batch ingestion from Apache Kafka to PostgreSQL: "
                       "Airflow plans offset ranges, PySpark reads them, one PostgreSQL "
                       "transaction commits rows and offsets.",
        "versions": [__version__],
        "integrations": [{"integration-name": INTEGRATION, "tags": ["software"]}],
        "plugins": [{"name": "offsetflow",
                     "plugin-class": f"{ORCHESTRATION}.plugin.OffsetFlowPlugin"}],
        # the [offsetflow] section: `airflow config list`, airflow.cfg, AIRFLOW__OFFSETFLOW__*
        "config": provider_config(),
    }
    for key, names in (("operators", ("operators",)), ("hooks", ("hooks",)),
                       ("sensors", ("sensors",)), ("triggers", ("triggers",))):
        mods = _modules(*names)
        if mods:
            info[key] = [{"integration-name": INTEGRATION, "python-modules": mods}]
    uris = _asset_uris()
    if uris:
        info["asset-uris"] = uris
    conns = _connection_types()
    if conns:
        info["connection-types"] = conns
    return info
