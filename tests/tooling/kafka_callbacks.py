"""librdkafka callbacks an Airflow `kafka` connection names by dotted path (the Kafka
provider resolves them when `[apache_kafka] callback_allowlist` lists them): importable
wherever a client is made, the Airflow task, the spark-submit driver and Spark's Python
workers, as a user's own would be."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def on_error(err: Any) -> None:
    """error_cb: librdkafka's errors to the log (they would go to stderr without it)."""
    log.warning("kafka client error: %s", err)
