-- Task-side Iceberg data files (sink.type iceberg, append): a stage part's task writes its
-- rows as Parquet data files into the table's location and records them here, in the SAME
-- transaction as its marker, so only the files of the attempt whose marker won are ever
-- committed (a losing attempt's files are orphans of the batch, swept after its commit).
-- NULL: the part's rows are in its PostgreSQL stage table (every other path).
ALTER TABLE offsetflow.staged_parts ADD COLUMN data_files jsonb;
