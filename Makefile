# OffsetFlow developer commands. Everything runs from the repo's own .venv and .stack/.
SHELL := /bin/bash
PY := .venv/bin/python
STACK := bash include/stack/stack.sh
ENV := set -a; source .stack/env.sh; set +a;
PYTEST_ARGS ?=

.PHONY: venv system system-browser up down status demo test check unit lint bench soak clean wheel spark-env docs pyc

venv: .venv/.installed

# the tested runtime (requirements.txt) and the repo's own tools (requirements-dev.txt: tests,
# lint, docs, bench), then the package itself, editable. Re-runs only when one of the three
# files changed, and then installs only what differs.
.venv/.installed: requirements.txt requirements-dev.txt pyproject.toml
	@command -v uv >/dev/null || python3 -m pip install -q uv
	@test -x $(PY) || uv venv .venv --python 3.11
	# --compile-bytecode: machines that set PYTHONDONTWRITEBYTECODE would otherwise compile
	# pandas, pyspark and airflow from source in every new process (Spark workers, tasks)
	# From uv's cache alone first (--offline: no index look-up, and the pyspark wheel built
	# before is used as it is); from the registry only when the cache lacks something (a pin
	# changed). Every install that reaches the registry unpacks and builds pyspark's sdist
	# again (~20 s and ~1.8 GB a time: this registry sends no cache headers); prune then keeps
	# only the newest of each
	@if uv pip install --offline --python $(PY) --compile-bytecode -r requirements-dev.txt; \
	then uv pip install --offline --python $(PY) --no-deps -e . || \
		uv pip install --python $(PY) --no-deps -e .; \
	else echo "[venv] not all in uv's cache: installing from the registry"; \
		uv pip install --python $(PY) --compile-bytecode -r requirements-dev.txt && \
		uv pip install --python $(PY) --no-deps -e . && uv cache prune -q; fi
	@$(PY) -c "import pyspark, sys; v = pyspark.__version__; print('pyspark', v); sys.exit(0 if v.startswith('4.') else 1)"
	@touch $@

# Debian packages the stack needs (PostgreSQL, curl, a JDK, Maven); the UI tests also need
# Chromium. Installs only what is missing (apt-get, sudo when not root); fast when all is there.
system:
	@bash include/stack/system-packages.sh

system-browser:
	@bash include/stack/system-packages.sh --browser

up: venv system
	$(STACK) up

down:
	@if [ -d .stack/serial ]; then $(SERIAL_STACK) down; fi
	$(STACK) down

status:
	$(STACK) status

demo: up
	$(ENV) $(PY) include/demo.py

# $(call test_paths,DEFAULT): DEFAULT unless PYTEST_ARGS names a path under tests/ itself, so
# that `make test PYTEST_ARGS="tests/integration/commit/test_sink.py -k name"` runs that file only
test_paths = $(if $(filter tests tests/% ./tests ./tests/%,$(PYTEST_ARGS)),,$(1))

unit: venv
	$(PY) -m pytest $(call test_paths,tests/unit) -q $(PYTEST_ARGS)

# all tests (what CI runs), in two streams at once: every test that leaves the shared services
# alone, on TEST_WORKERS pytest-xdist workers (a file's tests on one worker: module fixtures
# such as an Airflow on its own port stay single), against the stack of `make up`; and beside
# them, one at a time, the tests that stop, kill or crash a service (marked `serial` by
# tests/tooling/serial.py) against a second stack of their own (.stack/serial: Kafka,
# PostgreSQL, Spark Connect on the SERIAL_STACK ports). The serial stream's output follows
# the first's; at the end the 25 slowest tests and the wall time. With PYTEST_ARGS, one plain
# run of what they name: make test PYTEST_ARGS="tests/integration/commit"; PYTEST_ARGS="-m 'not slow'"
TEST_WORKERS ?= 3
PYTEST := $(PY) -m pytest -v -rs --timeout=900 --durations=25
RESULTS := .stack/test-results
# the serial stream's ports, exported for its stack.sh calls and its tests alike (the tests'
# kills and restarts call stack.sh: ports set in the caller's environment must not win)
# The serial stack starts no Spark Connect server and no schema registry: of its tests only
# test_connect_session.py uses the server (its spark_connect_url fixture starts it) and none
# the registry; both would idle beside the whole stream
SERIAL_ENV := OFFSETFLOW_STACK_DIR=$(CURDIR)/.stack/serial OFFSETFLOW_AIRFLOW=0 \
	OFFSETFLOW_CONNECT=0 OFFSETFLOW_SCHEMA_REGISTRY=0 \
	OFFSETFLOW_KAFKA_PORT=19192 OFFSETFLOW_KAFKA_CONTROLLER_PORT=19193 OFFSETFLOW_PG_PORT=15532 \
	OFFSETFLOW_AIRFLOW_PORT=18180 OFFSETFLOW_SPARK_CONNECT_PORT=15102 \
	OFFSETFLOW_SPARK_MASTER_PORT=17177 OFFSETFLOW_SPARK_MASTER_UI_PORT=17180 \
	OFFSETFLOW_SPARK_WORKER_PORT=17181 OFFSETFLOW_KAFKA_CLUSTER_PORT=17192 \
	OFFSETFLOW_SCHEMA_REGISTRY_PORT=18185
SERIAL_STACK := $(SERIAL_ENV) $(STACK)
# the test stacks' JVMs (brokers, Spark Connect, the clusters' daemons) C1-only with the serial
# collector (include/stack/stack.sh, OFFSETFLOW_JVM_LEAN): for `up` as a prerequisite of these
# too, and for the clusters the tests start. A stack already up keeps the flags it started with
test check: export OFFSETFLOW_JVM_LEAN = 1
# the repo's own modules compiled once into __pycache__ (git-ignored): where
# PYTHONDONTWRITEBYTECODE is set every process that imports offsetflow (job processes, Spark's
# Python workers, Airflow's task processes) compiled it from source again, ~0.2 CPU s each
pyc:
	@$(PY) -m compileall -q -j 0 plugins dags spark_jobs include tests >/dev/null
test: system-browser up pyc
ifeq ($(strip $(PYTEST_ARGS)),)
	@mkdir -p $(RESULTS); rm -f $(RESULTS)/*.xml $(RESULTS)/serial.log; start=$$(date +%s); \
	( export $(SERIAL_ENV) && $(STACK) up && set -a && source .stack/serial/env.sh && set +a && \
	  $(PYTEST) tests -m serial --junitxml=$(RESULTS)/serial.xml ) >$(RESULTS)/serial.log 2>&1 & \
	serial=$$!; \
	$(ENV) $(PYTEST) tests -m "not serial" -n $(TEST_WORKERS) --dist loadfile \
		--junitxml=$(RESULTS)/parallel.xml; rc1=$$?; \
	echo "[test] the serial tests (on .stack/serial), run beside the others:"; \
	wait $$serial; rc2=$$?; cat $(RESULTS)/serial.log; \
	$(PY) -m tests.tooling.slowest $$(( $$(date +%s) - start )) $(RESULTS)/parallel.xml \
		$(RESULTS)/serial.xml; \
	test $$rc1 -eq 0 -a $$rc2 -eq 0
else
	$(ENV) $(PYTEST) $(call test_paths,tests) $(PYTEST_ARGS)
endif

# the inner loop (under 5 minutes): the unit tests and the commit protocol's and the faults'
# integration core, in the same two streams at once as `make test` (the serial one on
# .stack/serial: it mostly waits on the restarts it causes, so run after the other it added
# its whole length). Test by test on the workers (`--dist load`): these files have no module
# fixtures, and test_faults.py alone (~165 s) kept on one worker would outlast the rest
CHECK_TESTS := tests/unit tests/integration/commit tests/integration/job/test_faults.py
check: up pyc
	@mkdir -p $(RESULTS); start=$$(date +%s); \
	( export $(SERIAL_ENV) && $(STACK) up && set -a && source .stack/serial/env.sh && set +a && \
	  $(PY) -m pytest -q -rs --timeout=900 $(CHECK_TESTS) -m serial ) >$(RESULTS)/check-serial.log 2>&1 & \
	serial=$$!; \
	$(ENV) $(PY) -m pytest -q -rs --timeout=900 $(CHECK_TESTS) -m "not serial" \
		-n $(TEST_WORKERS) --dist load; rc1=$$?; \
	echo "[check] the serial tests (on .stack/serial), run beside the others:"; \
	wait $$serial; rc2=$$?; cat $(RESULTS)/check-serial.log; \
	echo "[check] done in $$(( $$(date +%s) - start )) s"; test $$rc1 -eq 0 -a $$rc2 -eq 0

# ruff (with PLC2701: no private name imported across modules) and import-linter's
# contracts in pyproject.toml (the lifecycle's layers, no import circle)
lint: venv
	$(PY) -m ruff check plugins dags spark_jobs include tests
	.venv/bin/lint-imports
	$(PY) -m mypy
	$(PY) -m mypy include/soak  # scripts run from the repo root: outside the package list in pyproject.toml

# the documentation site (mkdocs.yml, docs/): strict, so a broken link, a config field
# without a description or a config example that does not parse fails it
docs: venv
	$(PY) -m mkdocs build --strict --site-dir .stack/site

# the installable provider package (pip install dist/offsetflow-*.whl into an Airflow 3)
wheel: venv
	uv build --wheel --out-dir dist .

# the executors' Python environment for a Spark cluster (offsetflow + its executor libraries,
# packed with venv-pack for spark.archives): .stack/spark-env/offsetflow-env.tar.gz
spark-env: venv
	$(STACK) spark-env

clean: down
	rm -rf .stack

# BENCH_ARGS e.g. "--records 100000 --scaling ''" for a quick look; results in bench-results/
bench: up
	$(ENV) $(PY) include/bench/bench.py $(BENCH_ARGS)

# a soak per sink, one after the other: SOAK_SINKS (default all three), SOAK_MINUTES per sink;
# SOAK_ARGS e.g. "--faults kill_kafka,kill_executor --seed 3"
soak: up
	$(ENV) $(PY) -m include.soak --sinks $${SOAK_SINKS:-postgres,iceberg,kafka} \
		--minutes $${SOAK_MINUTES:-10} $(SOAK_ARGS)
