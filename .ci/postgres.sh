#!/usr/bin/env bash
# Start (or reuse) a throwaway PostgreSQL server for the storage tests and benchmarks.
#
#   eval "$(bash .ci/postgres.sh | tail -1)"     # sets QKGEOM_TEST_PG_URL
#
# Idempotent: a server this script started earlier (same QKGEOM_PG_DIR) is reused, so a
# second call returns at once. Installs Debian's `postgresql` only when no initdb is found.
# The server listens on 127.0.0.1 only, on a free port, with a random password; its data
# directory, socket and log live under QKGEOM_PG_DIR (default /tmp/qkgeom-pg). The role
# may CREATE DATABASE (tests make one database per test). Stop it with:
#   runuser -u postgres -- pg_ctl -D "$QKGEOM_PG_DIR/data" stop
# Progress goes to stderr; the last line on stdout is the export line.
set -euo pipefail

dir=${QKGEOM_PG_DIR:-/tmp/qkgeom-pg}
db=${QKGEOM_PG_DB:-qkgeom_test}
user=${QKGEOM_PG_USER:-qkgeom}
log() { echo "postgres.sh: $*" >&2; }

find_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return 0; }
  return 1
}

bin=$(find_bin || true)
if [ -z "$bin" ]; then
  log "installing postgresql (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  (apt-get install -y -q postgresql >&2) || (apt-get update -q >&2 && apt-get install -y -q postgresql >&2)
  bin=$(find_bin)
fi

# run a command as the postgres system user (we are usually root in CI)
as_pg() {
  if [ "$(id -un)" = postgres ]; then "$@"
  elif [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"
  else log "run as root or as postgres"; exit 1; fi
}

url_line() {
  # shellcheck disable=SC1091
  . "$dir/env"
  echo "export QKGEOM_TEST_PG_URL=postgresql+psycopg://$user:$PGPASS@127.0.0.1:$PGPORT/$db"
}

if [ -f "$dir/env" ] && as_pg "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
  . "$dir/env"
  if as_pg "$bin/pg_isready" -q -h 127.0.0.1 -p "$PGPORT"; then
    log "reusing the server on 127.0.0.1:$PGPORT ($dir)"
    url_line
    exit 0
  fi
fi

free_port() {
  local p
  for p in $(seq 54329 54400); do
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return 0; fi
  done
  return 1
}

if [ ! -f "$dir/data/PG_VERSION" ]; then
  rm -rf "$dir"
  mkdir -p "$dir"
  PGPASS=$(head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n')
  pwfile=$(mktemp)
  echo "$PGPASS" >"$pwfile"
  chown -R postgres: "$dir" "$pwfile"
  chmod 700 "$dir"
  log "initdb in $dir/data"
  as_pg "$bin/initdb" -D "$dir/data" -U postgres --pwfile="$pwfile" \
    --auth-host=scram-sha-256 --auth-local=trust -E UTF8 >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; exit 1; }
  rm -f "$pwfile"
  printf 'PGPASS=%s\nPGPORT=\n' "$PGPASS" >"$dir/env"
  chmod 600 "$dir/env"
fi

. "$dir/env"
PGPORT=$(free_port)
sed -i "s/^PGPORT=.*/PGPORT=$PGPORT/" "$dir/env"
# fsync off and small WAL settings: a throwaway test server, speed over durability
as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 start -o \
  "-p $PGPORT -k $dir -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off" >&2 \
  || { tail -20 "$dir/server.log" >&2; exit 1; }
log "server up on 127.0.0.1:$PGPORT"

psql_pg() { as_pg "$bin/psql" -v ON_ERROR_STOP=1 -q -h "$dir" -p "$PGPORT" -U postgres -d postgres "$@"; }
if [ "$(psql_pg -tAc "SELECT 1 FROM pg_roles WHERE rolname = '$user'")" != 1 ]; then
  psql_pg -c "CREATE ROLE $user LOGIN CREATEDB PASSWORD '$PGPASS'"
fi
if [ "$(psql_pg -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
  psql_pg -c "CREATE DATABASE $db OWNER $user"
fi
url_line
