#!/usr/bin/env bash
# The machine-level set-up the README's commands need, in one place: `make up` (and so `make
# demo`, `make test`) and .ci/run all run it. Installs the missing Debian packages with
# apt-get (through sudo when not root) and checks what apt does not provide here.
#
#   system-packages.sh            PostgreSQL server and curl (the stack)
#   system-packages.sh --browser  also what only the tests use: Chromium (the UI tests drive
#                                 it headless) and Debian's docker-compose, whose `config`
#                                 checks docker-compose.yaml (no Docker engine is needed)
#
# Idempotent and fast when everything is present: it only looks at files on disk and runs
# apt-get (update first, once) only when something is missing.
set -euo pipefail

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

browser=0
for a in "$@"; do
  case "$a" in
    --browser) browser=1 ;;
    *) die "unknown argument '$a' (usage: $0 [--browser])" ;;
  esac
done

need=()
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need+=(postgresql)
command -v curl >/dev/null 2>&1 || need+=(curl)
# Kafka and Spark need Java 17+; Maven fetches Kafka's jars from Maven Central
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null 2>&1 || need+=(maven)
# the UI tests launch /usr/bin/chromium (Debian's package) by path
if (( browser )) && [[ ! -x /usr/bin/chromium ]]; then need+=(chromium); fi
# tests/unit/stack/test_docker_compose.py runs `docker compose config` or `docker-compose config`;
# without its recommends (they would bring the Docker engine, which nothing here runs)
lean=()
if (( browser )) && ! command -v docker-compose >/dev/null 2>&1 \
    && ! docker compose version >/dev/null 2>&1; then lean+=(docker-compose); fi

if ((${#need[@]} + ${#lean[@]})); then
  sudo=()
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || die "missing Debian packages (${need[*]}) and not root; install them or sudo"
    sudo=(sudo)
  fi
  log "installing Debian packages: ${need[*]} ${lean[*]}"
  "${sudo[@]}" apt-get update -qq >/dev/null \
    || die "apt-get update failed (needed for: ${need[*]} ${lean[*]})"
  if ((${#need[@]})); then
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null \
      || die "apt-get install ${need[*]} failed"
  fi
  if ((${#lean[@]})); then
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${lean[@]}" >/dev/null || die "apt-get install ${lean[*]} failed"
  fi
  # the Debian postgresql package may start a default cluster on 5432; the stack does not use it
fi

command -v java >/dev/null || die "no java on PATH after install (Kafka and Spark need Java 17+)"
command -v mvn >/dev/null || die "no mvn on PATH after install"
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 \
  || die "no PostgreSQL server under /usr/lib/postgresql/*/bin after install"
if (( browser )); then [[ -x /usr/bin/chromium ]] || die "no /usr/bin/chromium after install"; fi
if (( browser )); then
  command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 \
    || die "no docker-compose after install"
fi
exit 0
