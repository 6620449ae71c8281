-- The offsetflow database (ledger and targets) is POSTGRES_DB; Airflow's metadata lives apart.
CREATE DATABASE airflow;
