"""Registers OffsetFlow's Airflow plugin (lag and batch view under /offsetflow, Browse menu)
for an Airflow that reads this plugins folder without OffsetFlow being installed.

Airflow imports every .py file of its plugins folder (AIRFLOW__CORE__PLUGINS_FOLDER) and
registers the AirflowPlugin subclasses it finds; the plugin itself lives in the package. An
installed OffsetFlow (wheel or `pip install -e .`) registers it through its `airflow.plugins`
entry point already: exposing it here too would make Airflow report "Plugin 'offsetflow'
already registered" as a plugin import error.
"""

from importlib.metadata import entry_points

if not any(ep.value.startswith("offsetflow.") for ep in entry_points(group="airflow.plugins")):
    from offsetflow.orchestration.plugin import OffsetFlowPlugin

    __all__ = ["OffsetFlowPlugin"]
