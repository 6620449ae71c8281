"""OffsetFlow: exactly-once batch ingestion from Apache Kafka.

Airflow plans explicit per-partition offset ranges, a PySpark job reads exactly those
ranges, and results and offsets are committed to PostgreSQL in one transaction.
"""

__version__ = "0.1.0"
