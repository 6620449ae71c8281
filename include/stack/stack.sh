#!/usr/bin/env bash
# OffsetFlow's local stack: real Apache Kafka (KRaft), PostgreSQL and Airflow 3, on loopback,
# on non-default ports, with every byte of state under <repo>/.stack (git-ignored).
#
#   stack.sh up | down | status | env | logs [kafka|pg|airflow]
#   stack.sh kafka-start | kafka-stop | pg-start | pg-stop
#   stack.sh pg-crash | kafka-kill   (faults: pg_ctl stop -m immediate; kill -9 of the broker)
#   stack.sh airflow-setup | airflow-standalone-start | airflow-standalone-stop
#   stack.sh connect-start | connect-stop   (the warm Spark Connect server of `spark.launch: connect`;
#            up starts it unless OFFSETFLOW_CONNECT=0)
#   stack.sh spark-cluster-start | spark-cluster-stop | spark-worker-kill N | spark-env
#            (a Spark standalone master + 2 workers; the packed executor environment)
#   stack.sh kafka-cluster-start | kafka-cluster-stop | kafka-cluster-kill N | kafka-cluster-node-start N
#            (three KRaft brokers, one controller quorum, beside the single-broker stack)
#   stack.sh registry-start | registry-stop   (a Confluent-compatible Schema Registry for
#            `format.type: avro`, include/stack/schema_registry.py; up starts it unless
#            OFFSETFLOW_SCHEMA_REGISTRY=0: a stdlib Python process, ~50 ms)
#
# Idempotent: `up` on a running stack checks it and returns; `down` on a stopped one is a no-op.
# Every wait has a timeout; on failure the service, its host:port and the tail of its log are
# printed and the exit status is non-zero.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# OFFSETFLOW_STACK_DIR: a second stack beside the first (make test runs its fault tests on one)
STACK="${OFFSETFLOW_STACK_DIR:-$ROOT/.stack}"
VENV="$ROOT/.venv"
HERE="$ROOT/include/stack"

# A checkout remembers the ports it was first started on (.stack/ports), so a second
# checkout started with other OFFSETFLOW_*_PORT values keeps them in later calls.
if [[ -f "$STACK/ports" ]]; then
  while IFS='=' read -r k v; do
    [[ ( "$k" == OFFSETFLOW_*_PORT || "$k" == OFFSETFLOW_AIRFLOW || "$k" == OFFSETFLOW_JVM_LEAN ) \
       && -z "${!k:-}" ]] && export "$k=$v"
  done < "$STACK/ports"
fi
KAFKA_PORT="${OFFSETFLOW_KAFKA_PORT:-19092}"
CONTROLLER_PORT="${OFFSETFLOW_KAFKA_CONTROLLER_PORT:-19093}"
# a second listener of the same broker: SASL_PLAINTEXT, SCRAM-SHA-512 logins only; two above
# the plain one unless set (19094; a stack on other ports gets a free one beside its own)
KAFKA_SASL_PORT="${OFFSETFLOW_KAFKA_SASL_PORT:-$((KAFKA_PORT + 2))}"
KAFKA_SCRAM_USER="offsetflow"      # local development only, like PG_PASSWORD
KAFKA_SCRAM_PASSWORD="offsetflow"
PG_PORT="${OFFSETFLOW_PG_PORT:-15432}"
AIRFLOW_PORT="${OFFSETFLOW_AIRFLOW_PORT:-18080}"
REGISTRY_PORT="${OFFSETFLOW_SCHEMA_REGISTRY_PORT:-18081}"
PG_OS_USER="offsetflow"          # initdb refuses to run as root
PG_USER="offsetflow"
PG_PASSWORD="offsetflow"         # local development only
KAFKA_CLUSTER_ID="b2Zmc2V0Zmxvdy1sb2NhbA"   # fixed: the local stack is one static-quorum node
KAFKA_HEAP="${OFFSETFLOW_KAFKA_HEAP:--Xms256m -Xmx512m}"
KAFKA_TIMEOUT="${KAFKA_START_TIMEOUT:-180}"
PG_TIMEOUT="${PG_START_TIMEOUT:-90}"
AIRFLOW_TIMEOUT="${AIRFLOW_START_TIMEOUT:-180}"
CONNECT_PORT="${OFFSETFLOW_SPARK_CONNECT_PORT:-15002}"
CONNECT_MASTER="${OFFSETFLOW_SPARK_CONNECT_MASTER:-local[2]}"
CONNECT_TIMEOUT="${CONNECT_START_TIMEOUT:-180}"
# Spark standalone cluster: master RPC + UI ports; worker N uses WORKER_PORT+2(N-1) for RPC
# and the next port for its UI
SPARK_MASTER_PORT="${OFFSETFLOW_SPARK_MASTER_PORT:-17077}"
SPARK_MASTER_UI_PORT="${OFFSETFLOW_SPARK_MASTER_UI_PORT:-17080}"
SPARK_WORKER_PORT="${OFFSETFLOW_SPARK_WORKER_PORT:-17081}"
SPARK_WORKERS="${OFFSETFLOW_SPARK_WORKERS:-2}"
SPARK_WORKER_CORES="${OFFSETFLOW_SPARK_WORKER_CORES:-1}"
SPARK_WORKER_MEMORY="${OFFSETFLOW_SPARK_WORKER_MEMORY:-1g}"
SPARK_CLUSTER_TIMEOUT="${SPARK_CLUSTER_START_TIMEOUT:-180}"
# three-broker Kafka: node N listens on KAFKA_CLUSTER_PORT+2(N-1), its controller on the next
KAFKA_CLUSTER_PORT="${OFFSETFLOW_KAFKA_CLUSTER_PORT:-17092}"
KAFKA_CLUSTER_HEAP="${OFFSETFLOW_KAFKA_CLUSTER_HEAP:--Xms128m -Xmx384m}"
KAFKA_CLUSTER_ID3="b2Zmc2V0Zmxvdy1jbHVzdA"   # fixed: the local three-node quorum
# OFFSETFLOW_JVM_LEAN=1 (make test and make check set it; a stack remembers it in .stack/ports):
# the test stacks' long-lived JVMs (brokers, Spark Connect, the Spark cluster's daemons) on
# small data beside a CPU-bound suite on 2 cores. C1 only with one compiler thread, and the
# serial collector (no concurrent GC threads): the JIT's C2 compiles and G1's background
# work are most of what these JVMs burn while the tests barely use them. Off by default:
# `make up` for the demo and `make bench` measure the product's own settings.
JVM_LEAN="${OFFSETFLOW_JVM_LEAN:-0}"
if [[ "$JVM_LEAN" == 1 ]]; then
  JVM_OPTS="-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC -XX:-UsePerfData"
else
  JVM_OPTS="-XX:+UseG1GC"
fi

KAFKA_DIR="$STACK/kafka"
KAFKA_LOG="$KAFKA_DIR/kafka.log"
PG_DIR="$STACK/pg"
PG_LOG="$PG_DIR/postgres.log"
AIRFLOW_HOME_DIR="$STACK/airflow"
AIRFLOW_LOG="$AIRFLOW_HOME_DIR/standalone.log"
CONNECT_DIR="$STACK/connect"
CONNECT_LOG="$CONNECT_DIR/connect.log"
SPARK_CLUSTER_DIR="$STACK/spark-cluster"
SPARK_ENV_DIR="$STACK/spark-env"
KAFKA_CLUSTER_DIR="$STACK/kafka-cluster"
REGISTRY_DIR="$STACK/schema-registry"
REGISTRY_LOG="$REGISTRY_DIR/registry.log"

log() { printf '[stack] %s\n' "$*" >&2; }
die() { printf '[stack] ERROR: %s\n' "$*" >&2; exit 1; }

fail_service() {  # name, host:port, logfile, message
  printf '[stack] ERROR: %s on %s: %s\n' "$1" "$2" "$4" >&2
  if [[ -n "$3" && -f "$3" ]]; then
    printf '[stack] last 30 lines of %s:\n' "$3" >&2
    tail -n 30 "$3" >&2 || true
  fi
  exit 1
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# A killed process its parent has not reaped yet (a zombie) is not alive; but its main thread
# turns zombie before the others have exited and closed its sockets, so a process is alive
# while any of its threads is not a zombie.
proc_alive() {
  local t stat
  kill -0 "$1" 2>/dev/null || return 1
  for t in /proc/"$1"/task/*/stat; do
    stat="$(cat "$t" 2>/dev/null)" || continue
    stat="${stat##*) }"; [[ "${stat:0:1}" == [ZX] ]] || return 0
  done
  return 1
}
pid_alive() { [[ -f "$1" ]] && proc_alive "$(cat "$1")"; }
is_root() { [[ "$(id -u)" == 0 ]]; }

# ---------------------------------------------------------------- environment
write_env() {
  mkdir -p "$STACK"
  local java_home
  local airflow_db="export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=\"postgresql+psycopg2://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/airflow\""
  # a stack without Airflow (OFFSETFLOW_AIRFLOW=0) names no metadata database it lacks
  [[ "${OFFSETFLOW_AIRFLOW:-1}" != 0 ]] || airflow_db="# no Airflow metadata database (OFFSETFLOW_AIRFLOW=0)"
  java_home="${JAVA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")}"
  cat > "$STACK/env.sh.tmp" <<EOF
# generated by include/stack/stack.sh; source it to talk to the local stack
export PATH="$VENV/bin:\${PATH#$VENV/bin:}"
export JAVA_HOME="$java_home"
export PYSPARK_PYTHON="$VENV/bin/python"
export PYSPARK_DRIVER_PYTHON="$VENV/bin/python"
export OFFSETFLOW_STACK_DIR="$STACK"
export OFFSETFLOW_KAFKA_BOOTSTRAP="127.0.0.1:$KAFKA_PORT"
export OFFSETFLOW_KAFKA_SASL_BOOTSTRAP="127.0.0.1:$KAFKA_SASL_PORT"
export OFFSETFLOW_PG_DSN="postgresql://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/offsetflow"
export OFFSETFLOW_SPARK_CONNECT_URL="sc://127.0.0.1:$CONNECT_PORT"
export OFFSETFLOW_SPARK_MASTER_URL="spark://127.0.0.1:$SPARK_MASTER_PORT"
export OFFSETFLOW_SPARK_MASTER_UI="http://127.0.0.1:$SPARK_MASTER_UI_PORT"
export OFFSETFLOW_SPARK_ENV_ARCHIVE="$SPARK_ENV_DIR/offsetflow-env.tar.gz"
export OFFSETFLOW_KAFKA_CLUSTER_BOOTSTRAP="127.0.0.1:$KAFKA_CLUSTER_PORT,127.0.0.1:$((KAFKA_CLUSTER_PORT + 2)),127.0.0.1:$((KAFKA_CLUSTER_PORT + 4))"
export OFFSETFLOW_AIRFLOW_URL="http://127.0.0.1:$AIRFLOW_PORT"
export OFFSETFLOW_SCHEMA_REGISTRY_URL="http://127.0.0.1:$REGISTRY_PORT"
export AIRFLOW_HOME="$AIRFLOW_HOME_DIR"
export AIRFLOW__CORE__DAGS_FOLDER="$ROOT/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$ROOT/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES="False"
export AIRFLOW__CORE__EXECUTOR="LocalExecutor"
export AIRFLOW__CORE__PARALLELISM="4"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE="$AIRFLOW_HOME_DIR/simple_auth_manager_passwords.json"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$AIRFLOW_PORT/execution/"
$airflow_db
export AIRFLOW__API__HOST="127.0.0.1"
export AIRFLOW__API__PORT="$AIRFLOW_PORT"
export AIRFLOW__API__BASE_URL="http://127.0.0.1:$AIRFLOW_PORT"
export AIRFLOW__API_AUTH__JWT_SECRET="offsetflow-local-stack-jwt-secret"
export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5"
export AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="5"
export AIRFLOW__LOGGING__LOGGING_LEVEL="INFO"
# a task's calls to the execution API: the 5 s default timed out (httpx.ReadTimeout, task
# SIGKILLed, run failed) on a 2-core machine under a full test suite's load
export AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT="30"
EOF
  mv -f "$STACK/env.sh.tmp" "$STACK/env.sh"
  printf '%s\n' "OFFSETFLOW_KAFKA_PORT=$KAFKA_PORT" "OFFSETFLOW_KAFKA_CONTROLLER_PORT=$CONTROLLER_PORT" \
    "OFFSETFLOW_KAFKA_SASL_PORT=$KAFKA_SASL_PORT" \
    "OFFSETFLOW_PG_PORT=$PG_PORT" "OFFSETFLOW_AIRFLOW_PORT=$AIRFLOW_PORT" \
    "OFFSETFLOW_SPARK_CONNECT_PORT=$CONNECT_PORT" "OFFSETFLOW_SPARK_MASTER_PORT=$SPARK_MASTER_PORT" \
    "OFFSETFLOW_SPARK_MASTER_UI_PORT=$SPARK_MASTER_UI_PORT" "OFFSETFLOW_SPARK_WORKER_PORT=$SPARK_WORKER_PORT" \
    "OFFSETFLOW_KAFKA_CLUSTER_PORT=$KAFKA_CLUSTER_PORT" "OFFSETFLOW_SCHEMA_REGISTRY_PORT=$REGISTRY_PORT" \
    "OFFSETFLOW_AIRFLOW=${OFFSETFLOW_AIRFLOW:-1}" "OFFSETFLOW_JVM_LEAN=$JVM_LEAN" > "$STACK/ports"
}

cmd_env() { write_env; cat "$STACK/env.sh"; }

# ---------------------------------------------------------------- kafka
kafka_libs() {
  local libs="$KAFKA_DIR/libs" stamp="$KAFKA_DIR/libs.sha256" want
  want="$(sha256sum "$HERE/kafka/pom.xml" | cut -d' ' -f1)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && ls "$libs"/kafka_2.13-*.jar >/dev/null 2>&1; then
    return 0
  fi
  command -v mvn >/dev/null || die "Maven (mvn) is needed to fetch Apache Kafka from Maven Central"
  log "resolving Apache Kafka jars from Maven Central (cached in ~/.m2 after the first time)"
  rm -rf "$libs"; mkdir -p "$libs"
  mvn -B -q -f "$HERE/kafka/pom.xml" dependency:copy-dependencies \
      -DoutputDirectory="$libs" -DincludeScope=runtime >"$KAFKA_DIR/maven.log" 2>&1 \
    || { tail -n 30 "$KAFKA_DIR/maven.log" >&2; die "Maven could not fetch Kafka (see $KAFKA_DIR/maven.log)"; }
  echo "$want" > "$stamp"
}

kafka_version() { local j; j="$(ls "$KAFKA_DIR"/libs/kafka_2.13-*.jar 2>/dev/null | head -n1)"; j="${j##*/kafka_2.13-}"; echo "${j%.jar}"; }

storage_tool_class() {  # kafka.tools.StorageTool (Scala, in kafka_2.13) or the Java one in kafka-tools
  "$VENV/bin/python" - "$KAFKA_DIR/libs" <<'EOF'
import glob, sys, zipfile
names = set()
for jar in glob.glob(sys.argv[1] + "/kafka*.jar"):
    names.update(zipfile.ZipFile(jar).namelist())
for cls in ("kafka/tools/StorageTool.class", "org/apache/kafka/tools/StorageTool.class"):
    if cls in names:
        print(cls[:-len(".class")].replace("/", ".")); break
else:
    sys.exit("no StorageTool class in the Kafka jars")
EOF
}

kafka_ready() {
  timeout 15 "$VENV/bin/python" - "$KAFKA_PORT" <<'EOF' >/dev/null 2>&1
import sys
from confluent_kafka.admin import AdminClient
AdminClient({"bootstrap.servers": f"127.0.0.1:{sys.argv[1]}", "log_level": 0}).list_topics(timeout=3)
EOF
}

kafka_wait() {
  local deadline=$((SECONDS + KAFKA_TIMEOUT))
  until kafka_ready; do
    pid_alive "$KAFKA_DIR/kafka.pid" || fail_service kafka "127.0.0.1:$KAFKA_PORT" "$KAFKA_LOG" "the broker process exited"
    (( SECONDS < deadline )) || fail_service kafka "127.0.0.1:$KAFKA_PORT" "$KAFKA_LOG" "not ready after ${KAFKA_TIMEOUT}s"
    sleep 1
  done
}

kafka_start() {
  mkdir -p "$KAFKA_DIR"
  if pid_alive "$KAFKA_DIR/kafka.pid"; then
    kafka_wait; log "kafka already up on 127.0.0.1:$KAFKA_PORT"; return 0
  fi
  kafka_libs
  sed -e "s#@KAFKA_PORT@#$KAFKA_PORT#g" -e "s#@CONTROLLER_PORT@#$CONTROLLER_PORT#g" \
      -e "s#@KAFKA_SASL_PORT@#$KAFKA_SASL_PORT#g" \
      -e "s#@DATA_DIR@#$KAFKA_DIR/data#g" "$HERE/kafka/server.properties.template" \
      > "$KAFKA_DIR/server.properties"
  local cp="$KAFKA_DIR/libs/*" jvm_log=(-Dlog4j2.configurationFile="$HERE/kafka/log4j2.yaml" -Dkafka.logs.dir="$KAFKA_DIR")
  if [[ ! -f "$KAFKA_DIR/data/meta.properties" ]]; then
    local tool; tool="$(storage_tool_class)" || die "kafka: cannot find StorageTool in $KAFKA_DIR/libs"
    log "formatting Kafka storage (KRaft, cluster id $KAFKA_CLUSTER_ID, $tool)"
    java -Xmx256m "${jvm_log[@]}" -cp "$cp" "$tool" format --ignore-formatted \
         -t "$KAFKA_CLUSTER_ID" -c "$KAFKA_DIR/server.properties" >"$KAFKA_DIR/format.log" 2>&1 \
      || fail_service kafka "127.0.0.1:$KAFKA_PORT" "$KAFKA_DIR/format.log" "storage format failed"
  fi
  if port_open "$KAFKA_PORT" || port_open "$CONTROLLER_PORT" || port_open "$KAFKA_SASL_PORT"; then
    fail_service kafka "127.0.0.1:$KAFKA_PORT" "" "port $KAFKA_PORT, $CONTROLLER_PORT or $KAFKA_SASL_PORT is taken by a process not started by this stack"
  fi
  log "starting Kafka $(kafka_version) on 127.0.0.1:$KAFKA_PORT (controller 127.0.0.1:$CONTROLLER_PORT, SASL/SCRAM 127.0.0.1:$KAFKA_SASL_PORT)"
  # shellcheck disable=SC2086
  setsid nohup java $KAFKA_HEAP $JVM_OPTS -Djava.awt.headless=true "${jvm_log[@]}" \
      -cp "$cp" kafka.Kafka "$KAFKA_DIR/server.properties" \
      >"$KAFKA_DIR/stdout.log" 2>&1 < /dev/null &
  echo $! > "$KAFKA_DIR/kafka.pid"
  kafka_wait
  kafka_scram_user
  log "kafka ready"
}

# The SCRAM-SHA-512 login of the SASL listener (kept in the KRaft metadata log): set on every
# start, idempotent, through the unauthenticated PLAINTEXT listener (no authorizer here), so
# a stack formatted before the listener existed gets it too. Tests create users of their own.
kafka_scram_user() {
  timeout 30 "$VENV/bin/python" - "$KAFKA_PORT" "$KAFKA_SCRAM_USER" "$KAFKA_SCRAM_PASSWORD" <<'EOF' \
      >"$KAFKA_DIR/scram.log" 2>&1 || fail_service kafka "127.0.0.1:$KAFKA_SASL_PORT" "$KAFKA_DIR/scram.log" "creating the SCRAM user failed"
import sys
from confluent_kafka.admin import (AdminClient, ScramCredentialInfo, ScramMechanism,
                                   UserScramCredentialUpsertion)
port, user, password = sys.argv[1:]
import time
admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}", "log_level": 0})
info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
for attempt in range(5):  # a broker just started may not have its controller yet
    try:
        for f in admin.alter_user_scram_credentials(
                [UserScramCredentialUpsertion(user, info, password.encode())]).values():
            f.result(10)
        break
    except Exception as e:
        print(f"attempt {attempt + 1}: {e}", flush=True)
        if attempt == 4:
            raise
        time.sleep(1)
EOF
}

stop_pidfile() {  # name pidfile [timeout]
  local pidf="$2" t="${3:-30}"
  pid_alive "$pidf" || { rm -f "$pidf"; return 0; }
  local pid; pid="$(cat "$pidf")"
  log "stopping $1 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + t))
  while proc_alive "$pid"; do
    if (( SECONDS >= deadline )); then log "$1 did not stop in ${t}s; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; sleep 0.5; break; fi
    sleep 0.3
  done
  rm -f "$pidf"
}

kafka_stop() { stop_pidfile kafka "$KAFKA_DIR/kafka.pid" 60; }

# ---------------------------------------------------------------- postgres
pg_bindir() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true; }

pg_bin() {  # installs the server from Debian packages when it is missing
  local d; d="$(pg_bindir)"
  if [[ -z "$d" || ! -x "$d/postgres" ]]; then
    log "PostgreSQL server not found; installing the system packages"
    bash "$HERE/system-packages.sh" >&2 || die "postgres: installing the server failed"
    d="$(pg_bindir)"
    [[ -x "$d/postgres" ]] || die "postgres: no server binaries under /usr/lib/postgresql/*/bin after install"
  fi
  echo "$d"
}

psql_() {  # psql as the superuser over TCP
  local bin; bin="$(pg_bindir)"
  local psql="$bin/psql"; [[ -x "$psql" ]] || psql="psql"
  PGPASSWORD="$PG_PASSWORD" PGCONNECT_TIMEOUT=3 "$psql" -X -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" "$@"
}

as_pg() {  # run a command as the PostgreSQL OS user (initdb refuses root)
  if is_root; then runuser -u "$PG_OS_USER" -- "$@"; else "$@"; fi
}

pg_prepare_user() {
  is_root || return 0
  id "$PG_OS_USER" >/dev/null 2>&1 \
    || useradd --system --no-create-home --shell /usr/sbin/nologin "$PG_OS_USER" \
    || die "postgres: cannot create system user $PG_OS_USER"
  # the server user must be able to traverse the repo's path down to its data folder
  if ! runuser -u "$PG_OS_USER" -- test -x "$STACK"; then
    local d="$STACK"
    while [[ "$d" != "/" ]]; do chmod o+x "$d"; d="$(dirname "$d")"; done
    log "granted o+x on the parents of $STACK so $PG_OS_USER can reach its data"
  fi
  mkdir -p "$PG_DIR/run"
  chown "$PG_OS_USER:" "$PG_DIR" "$PG_DIR/run"
}

pg_ready() { psql_ -d postgres -tAc 'select 1' >/dev/null 2>&1; }

pg_start() {
  local bin; bin="$(pg_bin)"
  mkdir -p "$PG_DIR"
  pg_prepare_user
  if pg_ready; then log "postgres already up on 127.0.0.1:$PG_PORT"; pg_databases; return 0; fi
  if [[ ! -f "$PG_DIR/data/PG_VERSION" ]]; then
    log "initialising PostgreSQL cluster in $PG_DIR/data ($bin)"
    rm -rf "$PG_DIR/data"; mkdir -p "$PG_DIR/data"
    is_root && chown "$PG_OS_USER:" "$PG_DIR/data"
    local pwfile="$PG_DIR/run/pwfile"
    ( umask 077; printf '%s\n' "$PG_PASSWORD" > "$pwfile" )
    is_root && chown "$PG_OS_USER:" "$pwfile"
    as_pg "$bin/initdb" -D "$PG_DIR/data" -U "$PG_USER" --pwfile="$pwfile" \
      --auth-local=scram-sha-256 --auth-host=scram-sha-256 -E UTF8 --locale=C.UTF-8 >"$PG_DIR/initdb.log" 2>&1 \
      || { rm -f "$pwfile"; fail_service postgres "127.0.0.1:$PG_PORT" "$PG_DIR/initdb.log" "initdb failed"; }
    rm -f "$pwfile"
    printf "\n# OffsetFlow local stack (rewritten on every start)\ninclude_if_exists = 'offsetflow.conf'\n" \
      >> "$PG_DIR/data/postgresql.conf"
  fi
  grep -q "include_if_exists = 'offsetflow.conf'" "$PG_DIR/data/postgresql.conf" \
    || printf "\ninclude_if_exists = 'offsetflow.conf'\n" >> "$PG_DIR/data/postgresql.conf"
  # Sized for batch loads: a 1M-row commit writes ~0.5 GB of heap and WAL; small buffers and
  # a 1 GB WAL cap would make every large batch wait on checkpoints.
  cat > "$PG_DIR/data/offsetflow.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_DIR/run'
max_connections = 200
shared_buffers = ${OFFSETFLOW_PG_SHARED_BUFFERS:-512MB}
max_wal_size = 4GB
checkpoint_timeout = 15min
EOF
  is_root && chown "$PG_OS_USER:" "$PG_DIR/data/offsetflow.conf"
  if port_open "$PG_PORT"; then
    fail_service postgres "127.0.0.1:$PG_PORT" "" "the port is taken by a process not started by this stack"
  fi
  log "starting PostgreSQL on 127.0.0.1:$PG_PORT"
  touch "$PG_LOG"; is_root && chown "$PG_OS_USER:" "$PG_LOG"
  as_pg "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_LOG" -w -t "$PG_TIMEOUT" start >"$PG_DIR/pg_ctl.log" 2>&1 \
    || fail_service postgres "127.0.0.1:$PG_PORT" "$PG_LOG" "did not start within ${PG_TIMEOUT}s"
  local deadline=$((SECONDS + PG_TIMEOUT))
  until pg_ready; do
    (( SECONDS < deadline )) || fail_service postgres "127.0.0.1:$PG_PORT" "$PG_LOG" "not accepting TCP logins after ${PG_TIMEOUT}s"
    sleep 0.3
  done
  pg_databases
  log "postgres ready"
}

pg_databases() {
  local db
  for db in offsetflow airflow; do
    if [[ "$(psql_ -d postgres -tAc "select 1 from pg_database where datname='$db'")" != 1 ]]; then
      psql_ -d postgres -qc "CREATE DATABASE $db" >/dev/null \
        || fail_service postgres "127.0.0.1:$PG_PORT" "$PG_LOG" "CREATE DATABASE $db failed"
      log "created database $db"
    fi
  done
}

pg_stop() {
  local bin; bin="$(pg_bindir)"
  [[ -n "$bin" && -f "$PG_DIR/data/postmaster.pid" ]] || return 0
  log "stopping PostgreSQL"
  as_pg "$bin/pg_ctl" -D "$PG_DIR/data" -m fast -w -t 60 stop >/dev/null 2>&1 || true
  if [[ -f "$PG_DIR/data/postmaster.pid" ]]; then  # stale pid file or a stuck server
    local pid; pid="$(head -n1 "$PG_DIR/data/postmaster.pid")"
    if proc_alive "$pid"; then
      log "postgres did not stop; sending SIGQUIT"; kill -QUIT "$pid" 2>/dev/null || true; sleep 2
    fi
  fi
}

# Crash, not stop (fault tests and the soak): the server gets no shutdown checkpoint, so
# recovery replays WAL and resets every UNLOGGED table to empty, as after a host crash or a
# failover to a replica. `-m fast` would keep unlogged data.
pg_crash() {
  local bin; bin="$(pg_bindir)"
  [[ -n "$bin" && -f "$PG_DIR/data/postmaster.pid" ]] || die "postgres is not running"
  log "crashing PostgreSQL (pg_ctl stop -m immediate)"
  as_pg "$bin/pg_ctl" -D "$PG_DIR/data" -m immediate -w -t 60 stop >/dev/null 2>&1 || true
}

# SIGKILL the broker (no controlled shutdown, no log flush); kafka-start brings it back.
kafka_kill() {
  pid_alive "$KAFKA_DIR/kafka.pid" || die "kafka is not running"
  log "killing Kafka (kill -9)"
  kill -9 "$(cat "$KAFKA_DIR/kafka.pid")" 2>/dev/null || true
  local i; for ((i = 0; i < 100; i++)); do pid_alive "$KAFKA_DIR/kafka.pid" || break; sleep 0.1; done
  for ((i = 0; i < 100; i++)); do port_open "$KAFKA_PORT" || break; sleep 0.1; done
  rm -f "$KAFKA_DIR/kafka.pid"
}

# ---------------------------------------------------------------- airflow
load_env() { write_env; set -a; source "$STACK/env.sh"; set +a; }  # shellcheck disable=SC1091

airflow_setup() {
  load_env
  mkdir -p "$AIRFLOW_HOME_DIR"
  pg_ready || fail_service airflow "postgres 127.0.0.1:$PG_PORT/airflow" "$PG_LOG" "the metadata database is not reachable"
  # migrate once per (Airflow version, PostgreSQL cluster); `airflow db migrate` itself is idempotent
  local stamp="$AIRFLOW_HOME_DIR/.migrated" want
  want="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("apache-airflow"))')@$(psql_ -d postgres -tAc 'select system_identifier from pg_control_system()')"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] \
     || [[ "$(psql_ -d airflow -tAc "select count(*) from information_schema.tables where table_name='alembic_version'" 2>/dev/null)" != 1 ]]; then
    log "migrating the Airflow metadata database (airflow db migrate)"
    timeout 600 airflow db migrate >"$AIRFLOW_HOME_DIR/migrate.log" 2>&1 \
      || fail_service airflow "postgres 127.0.0.1:$PG_PORT/airflow" "$AIRFLOW_HOME_DIR/migrate.log" "airflow db migrate failed"
    echo "$want" > "$stamp"
  fi
  airflow_connections
}

airflow_connections() {
  # the expected rows, checked cheaply with psql; the Airflow CLI runs only when they differ
  local want have
  # offsetflow_kafka / offsetflow_postgres are what include/pipelines/*.yaml name (kafka.conn_id,
  # sink.conn_id): a `kafka` connection (librdkafka settings in its extra, as the Kafka
  # provider keeps them; host/port only for the check below) and a `postgres` one
  want="offsetflow_kafka|kafka|127.0.0.1|$KAFKA_PORT|
offsetflow_postgres|postgres|127.0.0.1|$PG_PORT|offsetflow
spark_default|spark|local[2]||"
  have="$(psql_ -d airflow -tAc "select conn_id||'|'||coalesce(conn_type,'')||'|'||coalesce(host,'')||'|'||coalesce(port::text,'')||'|'||coalesce(schema,'') from connection where conn_id in ('spark_default','offsetflow_postgres','offsetflow_kafka') order by conn_id" 2>/dev/null || true)"
  [[ "$have" == "$want" ]] && return 0
  log "creating/updating Airflow connections: spark_default (local[2]), offsetflow_postgres, offsetflow_kafka"
  local f="$AIRFLOW_HOME_DIR/connections.json"
  # spark_default's master must be percent-encoded in the URI, else the provider falls back to yarn
  cat > "$f" <<EOF
{
  "spark_default": "spark://local%5B2%5D",
  "offsetflow_postgres": "postgresql://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/offsetflow",
  "offsetflow_kafka": {"conn_type": "kafka", "host": "127.0.0.1", "port": $KAFKA_PORT,
                       "extra": {"bootstrap.servers": "127.0.0.1:$KAFKA_PORT"}}
}
EOF
  chmod 600 "$f"
  timeout 300 airflow connections import --overwrite "$f" >"$AIRFLOW_HOME_DIR/connections.log" 2>&1 \
    || fail_service airflow "postgres 127.0.0.1:$PG_PORT/airflow" "$AIRFLOW_HOME_DIR/connections.log" "airflow connections import failed"
  local host
  host="$(timeout 300 airflow connections get spark_default -o json 2>>"$AIRFLOW_HOME_DIR/connections.log" \
          | "$VENV/bin/python" -c 'import json,sys; d=json.load(sys.stdin); d=d[0] if isinstance(d,list) else d; print(d.get("host"))')" || true
  [[ "$host" == "local[2]" ]] || die "airflow: spark_default connection host is '$host', expected local[2]"
  have="$(psql_ -d airflow -tAc "select conn_id||'|'||coalesce(conn_type,'')||'|'||coalesce(host,'')||'|'||coalesce(port::text,'')||'|'||coalesce(schema,'') from connection where conn_id in ('spark_default','offsetflow_postgres','offsetflow_kafka') order by conn_id")"
  [[ "$have" == "$want" ]] || die "airflow: connections are not as expected after import:
$have"
}

airflow_ready() {  # the API answers and reports the metadata DB and the scheduler healthy
  curl -fsS -m 3 "http://127.0.0.1:$AIRFLOW_PORT/api/v2/monitor/health" 2>/dev/null | "$VENV/bin/python" -c '
import json, sys
d = json.load(sys.stdin)
sys.exit(0 if all(d.get(k, {}).get("status") == "healthy" for k in ("metadatabase", "scheduler")) else 1)' 2>/dev/null
}

standalone_start() {
  airflow_setup
  if pid_alive "$AIRFLOW_HOME_DIR/standalone.pid" && airflow_ready; then log "airflow standalone already up"; return 0; fi
  standalone_stop
  port_open "$AIRFLOW_PORT" && fail_service airflow "127.0.0.1:$AIRFLOW_PORT" "" "the port is taken by a process not started by this stack"
  log "starting airflow standalone on 127.0.0.1:$AIRFLOW_PORT (own process group)"
  setsid nohup airflow standalone >"$AIRFLOW_LOG" 2>&1 < /dev/null &
  echo $! > "$AIRFLOW_HOME_DIR/standalone.pid"
  local deadline=$((SECONDS + AIRFLOW_TIMEOUT))
  until airflow_ready; do
    pid_alive "$AIRFLOW_HOME_DIR/standalone.pid" || fail_service airflow "127.0.0.1:$AIRFLOW_PORT" "$AIRFLOW_LOG" "airflow standalone exited"
    (( SECONDS < deadline )) || fail_service airflow "127.0.0.1:$AIRFLOW_PORT" "$AIRFLOW_LOG" "/api/v2/monitor/health not OK after ${AIRFLOW_TIMEOUT}s"
    sleep 2
  done
  log "airflow standalone ready: http://127.0.0.1:$AIRFLOW_PORT (user admin, password in $AIRFLOW_HOME_DIR/simple_auth_manager_passwords.json)"
}

# Stop the process group whose leader's pid is in $2 (started with setsid): TERM, then KILL
# after 30 s.
stop_group() {
  local name="$1" pidf="$2"
  [[ -f "$pidf" ]] || return 0
  local pgid; pgid="$(cat "$pidf")"
  if kill -0 -- "-$pgid" 2>/dev/null; then
    log "stopping $name (process group $pgid)"
    kill -TERM -- "-$pgid" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while kill -0 -- "-$pgid" 2>/dev/null; do
      if (( SECONDS >= deadline )); then log "$name did not stop in 30s; SIGKILL"; kill -KILL -- "-$pgid" 2>/dev/null || true; sleep 0.5; break; fi
      sleep 0.3
    done
  fi
  rm -f "$pidf"
}

standalone_stop() { stop_group "airflow standalone" "$AIRFLOW_HOME_DIR/standalone.pid"; }

# ---------------------------------------------------------------- Spark Connect
# A long-running Spark driver that pipelines reach over gRPC (`spark.launch: connect`), so a
# batch pays no JVM or Python-worker start. pyspark ships the server jar; spark-submit starts
# its main class (what Spark's sbin/start-connect-server.sh does). Its Python workers run the
# venv's interpreter, so they import offsetflow from the same install as the client.
connect_start() { connect_launch; connect_wait; }

# the server's JVM started in the background (CONNECT_LAUNCHED=1), or left as it is when it is
# up with the current code; connect_wait then waits for it. `up` starts it before Kafka, so
# the two JVMs start at once
CONNECT_LAUNCHED=0
connect_launch() {
  write_env; load_env
  mkdir -p "$CONNECT_DIR"
  CONNECT_LAUNCHED=0
  if pid_alive "$CONNECT_DIR/connect.pid" && port_open "$CONNECT_PORT"; then
    # its reused Python workers keep the offsetflow modules they first imported: code
    # changed since the server started means a restart, not tasks running old code
    if [[ -z "$(find "$ROOT/plugins/offsetflow" -name '*.py' -newer "$CONNECT_DIR/connect.pid" -print -quit)" ]]; then
      log "spark connect already up on 127.0.0.1:$CONNECT_PORT"; return 0
    fi
    log "offsetflow changed since the Spark Connect server started: restarting it"
  fi
  connect_stop
  port_open "$CONNECT_PORT" && fail_service spark-connect "127.0.0.1:$CONNECT_PORT" "" "the port is taken by a process not started by this stack"
  log "starting Spark Connect server ($CONNECT_MASTER) on 127.0.0.1:$CONNECT_PORT"
  local -a connect_lean=()
  [[ "$JVM_LEAN" != 1 ]] || connect_lean=(--driver-java-options "$JVM_OPTS")
  # the server needs no credentials (each batch's client passes what its tasks use), and
  # anything that can reach its port can run code in it: it gets none in its environment
  local -a no_secrets=()
  local v
  for v in $(compgen -e); do
    [[ "$v" == *DSN* || "$v" == *PASSWORD* || "$v" == AIRFLOW_CONN_* || "$v" == *SECRET* || "$v" == *TOKEN* ]] && no_secrets+=(-u "$v")
  done
  env "${no_secrets[@]}" setsid nohup "$VENV/bin/spark-submit" --class org.apache.spark.sql.connect.service.SparkConnectServer \
    --name offsetflow-spark-connect --master "$CONNECT_MASTER" \
    --conf spark.connect.grpc.binding.address=127.0.0.1 \
    --conf "spark.connect.grpc.binding.port=$CONNECT_PORT" \
    --conf spark.ui.enabled=false --conf spark.sql.session.timeZone=UTC \
    --conf "spark.driver.memory=${OFFSETFLOW_SPARK_CONNECT_DRIVER_MEMORY:-2g}" \
    ${connect_lean[@]+"${connect_lean[@]}"} \
    >"$CONNECT_LOG" 2>&1 < /dev/null &
  echo $! > "$CONNECT_DIR/connect.pid"
  CONNECT_LAUNCHED=1
}

connect_wait() {
  [[ "$CONNECT_LAUNCHED" == 1 ]] || return 0
  local deadline=$((SECONDS + CONNECT_TIMEOUT))
  until port_open "$CONNECT_PORT" && grep -q "Spark Connect server started" "$CONNECT_LOG"; do
    pid_alive "$CONNECT_DIR/connect.pid" || fail_service spark-connect "127.0.0.1:$CONNECT_PORT" "$CONNECT_LOG" "the server exited"
    (( SECONDS < deadline )) || fail_service spark-connect "127.0.0.1:$CONNECT_PORT" "$CONNECT_LOG" "not listening after ${CONNECT_TIMEOUT}s"
    sleep 0.5
  done
  log "spark connect ready: sc://127.0.0.1:$CONNECT_PORT"
}

connect_stop() { stop_group "spark connect" "$CONNECT_DIR/connect.pid"; }

# ---------------------------------------------------------------- Spark standalone cluster
# A master and $SPARK_WORKERS workers started from pyspark's own jars with `spark-class` (pyspark
# ships no sbin start scripts), on loopback, state under .stack/spark-cluster. The workers get
# a clean environment (no venv on PATH, no PYTHONPATH, no PYSPARK_PYTHON): executors run only
# what a job ships them (spark.archives: the packed environment from `stack.sh spark-env`).
spark_home() {
  local d; d="$(ls -d "$VENV"/lib/python3*/site-packages/pyspark 2>/dev/null | head -n1)"
  [[ -n "$d" && -x "$d/bin/spark-class" ]] || die "no pyspark with bin/spark-class in $VENV; run 'make venv'"
  echo "$d"
}

spark_worker_ports() { echo "$((SPARK_WORKER_PORT + 2 * ($1 - 1))) $((SPARK_WORKER_PORT + 2 * ($1 - 1) + 1))"; }

spark_clean_env() {  # sets SPARK_CLEAN_ENV: the environment a cluster node's daemons start with
  local java_home lean=""
  [[ "$JVM_LEAN" != 1 ]] || lean=" $JVM_OPTS"
  local airflow_db="export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=\"postgresql+psycopg2://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/airflow\""
  # a stack without Airflow (OFFSETFLOW_AIRFLOW=0) names no metadata database it lacks
  [[ "${OFFSETFLOW_AIRFLOW:-1}" != 0 ]] || airflow_db="# no Airflow metadata database (OFFSETFLOW_AIRFLOW=0)"
  java_home="${JAVA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")}"
  SPARK_CLEAN_ENV=(env -i "HOME=$HOME" "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    "JAVA_HOME=$java_home" "SPARK_HOME=$(spark_home)" "SPARK_LOCAL_IP=127.0.0.1"
    "SPARK_DAEMON_MEMORY=${OFFSETFLOW_SPARK_DAEMON_MEMORY:-256m}" "LANG=C.UTF-8" "TZ=UTC"
    # no REST submission server (port 6066 for every cluster on the machine); a taken port
    # is an error, not a silent move to the next one (a worker's port, say)
    "SPARK_DAEMON_JAVA_OPTS=-Dspark.master.rest.enabled=false -Dspark.port.maxRetries=0$lean")
}

# The cluster ports sit in Linux's ephemeral range (32768-60999 by default): an outgoing
# connection can hold one for a moment, and a daemon started then fails to bind. Such a
# start is retried (a few times) instead of failing the stack.
bind_failed() { tail -n 60 "$1" 2>/dev/null | grep -q -e "Address already in use" -e "BindException"; }

SPARK_DAEMON_ENV=()  # more environment for the next spark_daemon (a worker's)

# Start a Spark daemon (spark-class CLASS ARGS) in a session of its own with the clean
# environment; its pid file holds the session leader, which spark-class execs into the JVM,
# so stop_group and spark-worker-kill reach the daemon and every executor it forked.
spark_daemon() {  # dir log class args...
  local dir="$1" logf="$2" i; shift 2
  rm -f "$dir/pid"
  spark_clean_env
  # shellcheck disable=SC2016
  ( cd "$dir" && exec setsid bash -c 'echo $$ > "$0"; exec "$@"' "$dir/pid" \
      "${SPARK_CLEAN_ENV[@]}" "SPARK_LOG_DIR=$dir" "${SPARK_DAEMON_ENV[@]}" "$(spark_home)/bin/spark-class" "$@" \
      >"$logf" 2>&1 < /dev/null ) &
  for ((i = 0; i < 100; i++)); do [[ -s "$dir/pid" ]] && return 0; sleep 0.1; done
  fail_service spark "$dir" "$logf" "the daemon did not start"
}

spark_alive_workers() {  # number of ALIVE workers the master reports (0 when it does not answer)
  curl -fsS -m 3 "http://127.0.0.1:$SPARK_MASTER_UI_PORT/json/" 2>/dev/null | "$VENV/bin/python" -c '
import json, sys
print(sum(1 for w in json.load(sys.stdin).get("workers", []) if w.get("state") == "ALIVE"))' 2>/dev/null || echo 0
}

spark_master_start() {
  local dir="$SPARK_CLUSTER_DIR/master"
  mkdir -p "$dir"
  if pid_alive "$dir/pid"; then return 0; fi
  { port_open "$SPARK_MASTER_PORT" || port_open "$SPARK_MASTER_UI_PORT"; } && fail_service spark-master \
    "127.0.0.1:$SPARK_MASTER_PORT" "" "port $SPARK_MASTER_PORT or $SPARK_MASTER_UI_PORT is taken by a process not started by this stack"
  log "starting Spark master on spark://127.0.0.1:$SPARK_MASTER_PORT (UI 127.0.0.1:$SPARK_MASTER_UI_PORT)"
  spark_daemon "$dir" "$dir/master.log" org.apache.spark.deploy.master.Master --host 127.0.0.1 \
    --port "$SPARK_MASTER_PORT" --webui-port "$SPARK_MASTER_UI_PORT"
  local deadline=$((SECONDS + SPARK_CLUSTER_TIMEOUT)) tries=0
  until curl -fsS -m 3 "http://127.0.0.1:$SPARK_MASTER_UI_PORT/json/" >/dev/null 2>&1; do
    if ! pid_alive "$dir/pid"; then
      if bind_failed "$dir/master.log" && (( ++tries <= 3 )); then
        log "spark master: a port was taken for a moment; starting it again"; sleep 2
        spark_daemon "$dir" "$dir/master.log" org.apache.spark.deploy.master.Master --host 127.0.0.1 \
          --port "$SPARK_MASTER_PORT" --webui-port "$SPARK_MASTER_UI_PORT"
        continue
      fi
      fail_service spark-master "127.0.0.1:$SPARK_MASTER_PORT" "$dir/master.log" "the master exited"
    fi
    (( SECONDS < deadline )) || fail_service spark-master "127.0.0.1:$SPARK_MASTER_PORT" "$dir/master.log" "not answering after ${SPARK_CLUSTER_TIMEOUT}s"
    sleep 0.5
  done
}

spark_worker_start() {  # N
  local n="$1" dir="$SPARK_CLUSTER_DIR/worker$1" ports port ui
  ports="$(spark_worker_ports "$n")"; port="${ports% *}"; ui="${ports#* }"
  mkdir -p "$dir/work"
  if pid_alive "$dir/pid"; then return 0; fi
  { port_open "$port" || port_open "$ui"; } && fail_service "spark-worker$n" "127.0.0.1:$port" "" \
    "port $port or $ui is taken by a process not started by this stack"
  log "starting Spark worker $n on 127.0.0.1:$port (UI $ui; $SPARK_WORKER_CORES core, $SPARK_WORKER_MEMORY)"
  # every application unpacks the shipped environment (~360 MB) into its directory on each
  # worker: the worker deletes a finished application's directory after a minute, and its
  # executors' scratch space (the fetched archive among it) sits under the worker's own
  # directory, not in /tmp, so a stop leaves nothing behind elsewhere
  mkdir -p "$dir/local"
  SPARK_DAEMON_ENV=("SPARK_LOCAL_DIRS=$dir/local"
    "SPARK_WORKER_OPTS=-Dspark.worker.cleanup.enabled=true -Dspark.worker.cleanup.interval=20 -Dspark.worker.cleanup.appDataTtl=40")
  spark_daemon "$dir" "$dir/worker.log" org.apache.spark.deploy.worker.Worker --host 127.0.0.1 \
    --port "$port" --webui-port "$ui" --cores "$SPARK_WORKER_CORES" --memory "$SPARK_WORKER_MEMORY" \
    --work-dir "$dir/work" "spark://127.0.0.1:$SPARK_MASTER_PORT"
  SPARK_DAEMON_ENV=()
}

spark_cluster_start() {
  write_env
  spark_master_start
  local n
  for ((n = 1; n <= SPARK_WORKERS; n++)); do spark_worker_start "$n"; done
  local deadline=$((SECONDS + SPARK_CLUSTER_TIMEOUT)) tries=0
  until [[ "$(spark_alive_workers)" -ge "$SPARK_WORKERS" ]]; do
    for ((n = 1; n <= SPARK_WORKERS; n++)); do
      pid_alive "$SPARK_CLUSTER_DIR/worker$n/pid" && continue
      if bind_failed "$SPARK_CLUSTER_DIR/worker$n/worker.log" && (( ++tries <= 3 )); then
        log "spark worker $n: a port was taken for a moment; starting it again"; sleep 2
        spark_worker_start "$n"; continue
      fi
      fail_service "spark-worker$n" "spark://127.0.0.1:$SPARK_MASTER_PORT" "$SPARK_CLUSTER_DIR/worker$n/worker.log" "the worker exited"
    done
    (( SECONDS < deadline )) || fail_service spark-cluster "spark://127.0.0.1:$SPARK_MASTER_PORT" "$SPARK_CLUSTER_DIR/master/master.log" "fewer than $SPARK_WORKERS workers registered after ${SPARK_CLUSTER_TIMEOUT}s"
    sleep 0.5
  done
  log "spark cluster ready: spark://127.0.0.1:$SPARK_MASTER_PORT with $SPARK_WORKERS workers (UI http://127.0.0.1:$SPARK_MASTER_UI_PORT)"
}

spark_cluster_stop() {  # workers first (each group holds its executors), then the master
  local d
  for d in "$SPARK_CLUSTER_DIR"/worker*; do
    [[ -d "$d" ]] && stop_group "spark $(basename "$d")" "$d/pid"
  done
  stop_group "spark master" "$SPARK_CLUSTER_DIR/master/pid"
  # what a worker's cleanup had no time for: the last applications' unpacked environments
  # and the executors' scratch space (their stderr logs stay)
  rm -rf "$SPARK_CLUSTER_DIR"/worker*/work/app-*/*/"environment" "$SPARK_CLUSTER_DIR"/worker*/local/*
}

# A node lost: SIGKILL of worker N's process group (the worker and its executor JVMs).
spark_worker_kill() {
  local n="${1:?usage: spark-worker-kill N}" pidf="$SPARK_CLUSTER_DIR/worker$1/pid"
  pid_alive "$pidf" || die "spark worker $n is not running"
  log "killing Spark worker $n and its executors (kill -9 of process group $(cat "$pidf"))"
  kill -KILL -- "-$(cat "$pidf")" 2>/dev/null || true
  # the executors' Python daemons put themselves in process groups of their own: on a lost
  # node they die too (found by their working directory, the executor's)
  local p cwd
  for p in /proc/[0-9]*; do
    cwd="$(readlink "$p/cwd" 2>/dev/null)" || continue
    [[ "$cwd" == "$SPARK_CLUSTER_DIR/worker$n/"* ]] && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  rm -f "$pidf"
}

# The executors' Python environment: offsetflow (a wheel, not the editable install) and the
# libraries its executor code imports, in a venv of its own packed with venv-pack. Jobs ship
# it with spark.archives=<tar.gz>#environment and spark.pyspark.python=./environment/bin/python.
# The venv's bin/python links to this machine's Python 3.11 (venv-pack does not pack the
# interpreter): cluster nodes need Python 3.11 at that path (or use a conda-pack/an image).
SPARK_ENV_PACKAGES='^(confluent-kafka|pyarrow|psycopg2-binary|pyyaml|pandas|numpy|fastavro|python-dateutil|pytz|tzdata|six)=='
spark_env() {
  local out="$SPARK_ENV_DIR/offsetflow-env.tar.gz" venv="$SPARK_ENV_DIR/venv" want
  want="$(cd "$ROOT" && { cat requirements.txt pyproject.toml; find plugins/offsetflow -type f \
          \( -name '*.py' -o -name '*.sql' -o -name '*.html' \) | sort | xargs cat; } | sha256sum | cut -d' ' -f1)"
  if [[ -f "$out" && "$(cat "$SPARK_ENV_DIR/stamp" 2>/dev/null)" == "$want" ]]; then
    log "executor environment up to date: $out"; return 0
  fi
  [[ -x "$VENV/bin/venv-pack" ]] || die "venv-pack is missing from $VENV; run 'make venv'"
  local base; base="$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')"
  log "building the executor environment ($venv, Python $base)"
  rm -rf "$venv" "$SPARK_ENV_DIR/build"; mkdir -p "$SPARK_ENV_DIR"
  uv venv -q "$venv" --python "$base" >&2
  # shellcheck disable=SC2046
  uv pip install -q --python "$venv/bin/python" --compile-bytecode \
      $(grep -E "$SPARK_ENV_PACKAGES" "$ROOT/requirements.txt") >&2
  # a wheel built from a copy: a non-editable install, and no build/ or egg-info in the checkout
  mkdir -p "$SPARK_ENV_DIR/build"
  cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/LICENSE" "$ROOT/plugins" "$SPARK_ENV_DIR/build/"
  uv pip install -q --python "$venv/bin/python" --compile-bytecode --no-deps "$SPARK_ENV_DIR/build" >&2
  rm -rf "$SPARK_ENV_DIR/build"
  "$VENV/bin/venv-pack" -q -p "$venv" -o "$SPARK_ENV_DIR/tmp-env.tar.gz" --force >&2 || die "venv-pack failed"
  mv -f "$SPARK_ENV_DIR/tmp-env.tar.gz" "$out"
  echo "$want" > "$SPARK_ENV_DIR/stamp"
  log "executor environment packed: $out ($(du -h "$out" | cut -f1))"
}

# ---------------------------------------------------------------- schema registry
registry_ready() { curl -fsS -m 2 "http://127.0.0.1:$REGISTRY_PORT/subjects" >/dev/null 2>&1; }

registry_start() {
  mkdir -p "$REGISTRY_DIR"
  if pid_alive "$REGISTRY_DIR/registry.pid" && registry_ready; then
    log "schema registry already up on 127.0.0.1:$REGISTRY_PORT"; return 0
  fi
  registry_stop
  port_open "$REGISTRY_PORT" && fail_service schema-registry "127.0.0.1:$REGISTRY_PORT" "" "the port is taken by a process not started by this stack"
  log "starting the schema registry on 127.0.0.1:$REGISTRY_PORT (schemas in $REGISTRY_DIR/schemas.json)"
  setsid nohup "$VENV/bin/python" "$HERE/schema_registry.py" --port "$REGISTRY_PORT" \
      --data "$REGISTRY_DIR/schemas.json" >"$REGISTRY_LOG" 2>&1 < /dev/null &
  echo $! > "$REGISTRY_DIR/registry.pid"
  local deadline=$((SECONDS + 15))
  until registry_ready; do
    pid_alive "$REGISTRY_DIR/registry.pid" || fail_service schema-registry "127.0.0.1:$REGISTRY_PORT" "$REGISTRY_LOG" "the process exited"
    (( SECONDS < deadline )) || fail_service schema-registry "127.0.0.1:$REGISTRY_PORT" "$REGISTRY_LOG" "not answering after 15s"
    sleep 0.1
  done
}

registry_stop() { stop_pidfile "schema registry" "$REGISTRY_DIR/registry.pid" 10; }

# ---------------------------------------------------------------- three-broker Kafka
kafka_cluster_port() { echo "$((KAFKA_CLUSTER_PORT + 2 * ($1 - 1)))"; }
kafka_cluster_bootstrap() { echo "127.0.0.1:$(kafka_cluster_port 1),127.0.0.1:$(kafka_cluster_port 2),127.0.0.1:$(kafka_cluster_port 3)"; }

kafka_cluster_ready() {  # all three brokers registered and answering
  timeout 15 "$VENV/bin/python" - "$(kafka_cluster_bootstrap)" <<'EOF' >/dev/null 2>&1
import sys
from confluent_kafka.admin import AdminClient
md = AdminClient({"bootstrap.servers": sys.argv[1], "log_level": 0}).list_topics(timeout=5)
sys.exit(0 if len(md.brokers) == 3 else 1)
EOF
}

kafka_cluster_node_start() {  # N
  local n="$1" dir="$KAFKA_CLUSTER_DIR/node$1" port cport voters="" i
  port="$(kafka_cluster_port "$n")"; cport=$((port + 1))
  for i in 1 2 3; do voters+="${voters:+,}$i@127.0.0.1:$(( $(kafka_cluster_port "$i") + 1 ))"; done
  mkdir -p "$dir"
  pid_alive "$dir/kafka.pid" && return 0
  kafka_libs
  sed -e "s#@NODE_ID@#$n#g" -e "s#@VOTERS@#$voters#g" -e "s#@KAFKA_PORT@#$port#g" \
      -e "s#@CONTROLLER_PORT@#$cport#g" -e "s#@DATA_DIR@#$dir/data#g" \
      "$HERE/kafka/cluster.properties.template" > "$dir/server.properties"
  local cp="$KAFKA_DIR/libs/*" jvm_log=(-Dlog4j2.configurationFile="$HERE/kafka/log4j2.yaml" -Dkafka.logs.dir="$dir")
  if [[ ! -f "$dir/data/meta.properties" ]]; then
    local tool; tool="$(storage_tool_class)" || die "kafka: cannot find StorageTool in $KAFKA_DIR/libs"
    java -Xmx256m "${jvm_log[@]}" -cp "$cp" "$tool" format --ignore-formatted \
         -t "$KAFKA_CLUSTER_ID3" -c "$dir/server.properties" >"$dir/format.log" 2>&1 \
      || fail_service "kafka node $n" "127.0.0.1:$port" "$dir/format.log" "storage format failed"
  fi
  { port_open "$port" || port_open "$cport"; } && fail_service "kafka node $n" "127.0.0.1:$port" "" \
    "port $port or $cport is taken by a process not started by this stack"
  log "starting Kafka node $n on 127.0.0.1:$port (controller 127.0.0.1:$cport)"
  # shellcheck disable=SC2086
  setsid nohup java $KAFKA_CLUSTER_HEAP $JVM_OPTS -Djava.awt.headless=true "${jvm_log[@]}" \
      -cp "$cp" kafka.Kafka "$dir/server.properties" >"$dir/stdout.log" 2>&1 < /dev/null &
  echo $! > "$dir/kafka.pid"
}

kafka_cluster_alive() {  # every node's process runs (a dead one may still be listed a while)
  local i; for i in 1 2 3; do pid_alive "$KAFKA_CLUSTER_DIR/node$i/kafka.pid" || return 1; done
}

kafka_cluster_wait() {
  local deadline=$((SECONDS + KAFKA_TIMEOUT * 2)) i tries=0
  until kafka_cluster_ready && kafka_cluster_alive; do
    for i in 1 2 3; do
      [[ -f "$KAFKA_CLUSTER_DIR/node$i/kafka.pid" ]] || continue
      pid_alive "$KAFKA_CLUSTER_DIR/node$i/kafka.pid" && continue
      if bind_failed "$KAFKA_CLUSTER_DIR/node$i/kafka.log" && (( ++tries <= 3 )); then
        log "kafka node $i: its port was taken for a moment; starting it again"
        rm -f "$KAFKA_CLUSTER_DIR/node$i/kafka.pid"; sleep 2; kafka_cluster_node_start "$i"; continue
      fi
      fail_service "kafka node $i" "127.0.0.1:$(kafka_cluster_port "$i")" "$KAFKA_CLUSTER_DIR/node$i/kafka.log" "the broker process exited"
    done
    (( SECONDS < deadline )) || fail_service kafka-cluster "127.0.0.1:$(kafka_cluster_port 1)" "$KAFKA_CLUSTER_DIR/node1/kafka.log" "not 3 brokers after $((KAFKA_TIMEOUT * 2))s"
    sleep 1
  done
}

kafka_cluster_start() {
  write_env
  local i
  for i in 1 2 3; do kafka_cluster_node_start "$i"; done  # a quorum needs two: start all, then wait
  kafka_cluster_wait
  log "kafka cluster ready: $(kafka_cluster_bootstrap)"
}

# All three at once: stopped one by one, the last node waits for a quorum that is gone
# (its controlled shutdown never finishes) until the SIGKILL.
kafka_cluster_stop() {
  local i pids=() deadline=$((SECONDS + 30))
  for i in 1 2 3; do
    pid_alive "$KAFKA_CLUSTER_DIR/node$i/kafka.pid" && pids+=("$(cat "$KAFKA_CLUSTER_DIR/node$i/kafka.pid")")
  done
  if (( ${#pids[@]} )); then
    log "stopping kafka cluster nodes (pids ${pids[*]})"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local alive=1 p
    while (( alive && SECONDS < deadline )); do
      alive=0; for p in "${pids[@]}"; do proc_alive "$p" && alive=1; done
      (( alive )) && sleep 0.3
    done
    for i in "${pids[@]}"; do
      proc_alive "$i" && { log "kafka node pid $i did not stop in 30s; SIGKILL"; kill -KILL "$i" 2>/dev/null || true; }
    done
  fi
  rm -f "$KAFKA_CLUSTER_DIR"/node*/kafka.pid
}

# SIGKILL of node N (no controlled shutdown: leadership moves only when the controller notices)
kafka_cluster_kill() {
  local n="${1:?usage: kafka-cluster-kill N}" pidf="$KAFKA_CLUSTER_DIR/node$1/kafka.pid"
  pid_alive "$pidf" || die "kafka node $n is not running"
  log "killing Kafka node $n (kill -9)"
  kill -9 "$(cat "$pidf")" 2>/dev/null || true
  local i; for ((i = 0; i < 100; i++)); do pid_alive "$pidf" || break; sleep 0.1; done
  rm -f "$pidf"
}

# ---------------------------------------------------------------- commands
# The broker stops for good when its log directory cannot be written (a full disk), and
# the test suite needs ~6 GB at its peak (the Spark cluster tests unpack the ~360 MB executor
# environment per application on each worker): warn before anything starts
disk_warn() {
  local free_kb; free_kb="$(df -Pk "$STACK" | awk 'NR == 2 {print $4}')"
  if (( free_kb < ${OFFSETFLOW_MIN_FREE_GB:-6} * 1024 * 1024 )); then
    log "WARNING: only $((free_kb / 1024)) MB free on the disk of $STACK; Kafka and PostgreSQL stop when it fills, and 'make test' needs about ${OFFSETFLOW_MIN_FREE_GB:-6} GB"
  fi
}

cmd_up() {
  [[ -x "$VENV/bin/python" ]] || die "no virtualenv at $VENV; run 'make venv' first"
  local t0=$SECONDS
  write_env
  disk_warn
  pg_start
  # the warm path the shipped pipelines take (`spark.launch: connect`): no JVM or Python
  # worker start per batch; OFFSETFLOW_CONNECT=0 leaves it out (connect-start later). Its
  # JVM starts here and is waited for after Kafka's and the Airflow set-up: the three
  # overlap instead of one after the other (a failure still names its service and log)
  if [[ "${OFFSETFLOW_CONNECT:-1}" != 0 ]]; then connect_launch; fi
  kafka_start
  # OFFSETFLOW_AIRFLOW=0: no Airflow metadata database (the fault tests' stack needs none)
  if [[ "${OFFSETFLOW_AIRFLOW:-1}" != 0 ]]; then airflow_setup; fi
  if [[ "${OFFSETFLOW_CONNECT:-1}" != 0 ]]; then connect_wait; fi
  # format.type avro's registry: a stdlib Python process, started in well under a second
  if [[ "${OFFSETFLOW_SCHEMA_REGISTRY:-1}" != 0 ]]; then registry_start; fi
  log "stack up in $((SECONDS - t0))s: kafka $(kafka_version) 127.0.0.1:$KAFKA_PORT, postgres 127.0.0.1:$PG_PORT; env: source .stack/env.sh"
}

cmd_down() {
  spark_cluster_stop
  kafka_cluster_stop
  connect_stop
  registry_stop
  standalone_stop
  kafka_stop
  pg_stop
  log "stack down"
}

cmd_status() {
  local rc=0
  if kafka_ready; then echo "kafka     up    127.0.0.1:$KAFKA_PORT  (Apache Kafka $(kafka_version), KRaft; SASL/SCRAM-SHA-512 on 127.0.0.1:$KAFKA_SASL_PORT)"; else echo "kafka     down  127.0.0.1:$KAFKA_PORT"; rc=1; fi
  if pg_ready; then echo "postgres  up    127.0.0.1:$PG_PORT"; else echo "postgres  down  127.0.0.1:$PG_PORT"; rc=1; fi
  if pid_alive "$CONNECT_DIR/connect.pid" && port_open "$CONNECT_PORT"; then echo "connect   up    127.0.0.1:$CONNECT_PORT  (Spark Connect)"; else echo "connect   down  127.0.0.1:$CONNECT_PORT  (make up starts it unless OFFSETFLOW_CONNECT=0; stack.sh connect-start)"; fi
  if pid_alive "$REGISTRY_DIR/registry.pid" && registry_ready; then echo "registry  up    127.0.0.1:$REGISTRY_PORT  (schema registry)"; else echo "registry  down  127.0.0.1:$REGISTRY_PORT  (stack.sh registry-start)"; fi
  if airflow_ready; then echo "airflow   up    127.0.0.1:$AIRFLOW_PORT  (standalone)"; else echo "airflow   down  127.0.0.1:$AIRFLOW_PORT  (standalone is optional: stack.sh airflow-standalone-start)"; fi
  return $rc
}

cmd_logs() {
  local n="${2:-50}"
  case "${1:-all}" in
    kafka) tail -n "$n" "$KAFKA_LOG" ;;
    postgres|pg) tail -n "$n" "$PG_LOG" ;;
    airflow) tail -n "$n" "$AIRFLOW_LOG" ;;
    connect) tail -n "$n" "$CONNECT_LOG" ;;
    registry) tail -n "$n" "$REGISTRY_LOG" ;;
    all) for f in "$KAFKA_LOG" "$PG_LOG" "$AIRFLOW_LOG"; do
           [[ -f "$f" ]] && { echo "== $f"; tail -n 20 "$f"; }
         done; true ;;
    *) die "logs: unknown service '$1' (kafka|pg|airflow)" ;;
  esac
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  logs) shift; cmd_logs "${1:-all}" "${2:-50}" ;;
  kafka-start) write_env; kafka_start ;;
  kafka-stop) kafka_stop ;;
  pg-start) write_env; pg_start ;;
  pg-stop) pg_stop ;;
  pg-crash) pg_crash ;;
  kafka-kill) kafka_kill ;;
  airflow-setup) airflow_setup ;;
  airflow-standalone-start) standalone_start ;;
  airflow-standalone-stop) standalone_stop ;;
  connect-start) connect_start ;;
  connect-stop) connect_stop ;;
  registry-start) write_env; registry_start ;;
  registry-stop) registry_stop ;;
  spark-cluster-start) spark_cluster_start ;;
  spark-cluster-stop) spark_cluster_stop ;;
  spark-worker-kill) spark_worker_kill "${2:-}" ;;
  spark-worker-start) write_env; spark_worker_start "${2:?usage: spark-worker-start N}" ;;
  spark-env) write_env; spark_env ;;
  kafka-cluster-start) kafka_cluster_start ;;
  kafka-cluster-stop) kafka_cluster_stop ;;
  kafka-cluster-kill) kafka_cluster_kill "${2:-}" ;;
  kafka-cluster-node-start) write_env; kafka_cluster_node_start "${2:?usage: kafka-cluster-node-start N}"; kafka_cluster_wait ;;
  *) echo "usage: $0 up|down|status|env|logs [kafka|pg|airflow|connect|registry]|kafka-start|kafka-stop|kafka-kill|pg-start|pg-stop|pg-crash|airflow-setup|airflow-standalone-start|airflow-standalone-stop|connect-start|connect-stop|registry-start|registry-stop|spark-cluster-start|spark-cluster-stop|spark-worker-kill N|spark-worker-start N|spark-env|kafka-cluster-start|kafka-cluster-stop|kafka-cluster-kill N|kafka-cluster-node-start N" >&2; exit 2 ;;
esac
