"""Registers OffsetFlow's Airflow plugin (lag and batch view under /offsetflow, Browse menu).

Airflow imports every .py file of its plugins folder (AIRFLOW__CORE__PLUGINS_FOLDER) and
registers the AirflowPlugin subclasses it finds; the plugin itself lives in the package.
"""

from offsetflow.orchestration.plugin import OffsetFlowPlugin

__all__ = ["OffsetFlowPlugin"]
