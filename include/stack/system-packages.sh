#!/usr/bin/env bash
# The machine-level set-up the README's commands need, in one place: `make up` (and so `make
# demo`, `make test`) and .ci/run all run it. Installs the missing Debian packages with
# apt-get (through sudo when not root) and checks what apt does not provide here.
#
#   system-packages.sh            PostgreSQL server and curl (the stack)
#   system-packages.sh --browser  also Chromium (the UI tests drive it headless)
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

if ((${#need[@]})); then
  sudo=()
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || die "missing Debian packages (${need[*]}) and not root; install them or sudo"
    sudo=(sudo)
  fi
  log "installing Debian packages: ${need[*]}"
  "${sudo[@]}" apt-get update -qq >/dev/null \
    || die "apt-get update failed (needed for: ${need[*]})"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null \
    || die "apt-get install ${need[*]} failed"
  # the Debian postgresql package may start a default cluster on 5432; the stack does not use it
fi

command -v java >/dev/null || die "no java on PATH after install (Kafka and Spark need Java 17+)"
command -v mvn >/dev/null || die "no mvn on PATH after install"
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 \
  || die "no PostgreSQL server under /usr/lib/postgresql/*/bin after install"
if (( browser )); then [[ -x /usr/bin/chromium ]] || die "no /usr/bin/chromium after install"; fi
exit 0
