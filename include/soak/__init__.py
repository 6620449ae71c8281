"""`make soak`: a soak per sink (PostgreSQL, Iceberg, Kafka topic), one after the other.
Producers keep writing (transactions abort at random) while batches run and the faults that
apply to the sink are injected round-robin; at the end the exactly-once checker judges what
the sink holds, read back as readers see it (SQL, a pyiceberg scan, a read_committed
consumer).

    .venv/bin/python -m include.soak --sinks postgres,iceberg,kafka --minutes 10 [--seed 7]

`--minutes` is per sink; the first round always completes, so every fault that applies is
injected at least once however short it is; `--faults a,b` runs a subset. Faults: the run
killed at every stage (while it reads, after staging, inside and after the sink's own
commit, after the ledger's), a Spark task failing, the commit connection cut, PostgreSQL
restarted and crashed (`-m immediate`) at the fence and at the sink's commit, the broker
restarted and killed with kill -9 (while a batch reads; at a Kafka sink's commit), a Spark
Python worker killed, two runs of one batch at once, 1 MB records, tombstones, `offsetflow
replay` of a committed window beside the live batch (killed half of the time), maintenance
runs beside an open batch (`offsetflow cleanup`; Iceberg snapshot expiry and orphan sweep).

Prints per sink: records produced, committed, lost, duplicated, aborted visible, dead
letters, faults by kind, batches retried, wall time (and `test-output/soak/<run>-<sink>/
figures.json`); exits 1 when any sink lost, duplicated or showed anything, or wedged.

The sink-specific part (its config, the faults that apply, its commit's fault points, its
maintenance, reading its target back) is a class in `sinks.py`; the faults in `faults.py`;
the run (producers, cycles, drain, verdict) in `run.py`.
"""
