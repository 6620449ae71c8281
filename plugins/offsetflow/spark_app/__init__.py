"""The Spark application file the operators submit (`run_batch.py`), shipped inside the
package (`offsetflow.orchestration.operators.SPARK_JOB` names it).

An installed OffsetFlow (wheel, `pip install .`) has no repo around it, so spark-submit gets
this package's `run_batch.py`. It lives in a folder of its own because Python puts a script's
folder first on sys.path: next to the other modules, `offsetflow/plan/requests.py` would shadow
the `requests` library in the Spark driver.
"""

