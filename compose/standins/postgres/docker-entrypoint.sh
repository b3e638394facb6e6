#!/bin/bash
# First start: initdb, the user and the database, password authentication from any
# address (the database sits on the stack's private network). Later starts: just run.
set -euo pipefail

user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
password=${POSTGRES_PASSWORD:-}
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then password=$(cat "$POSTGRES_PASSWORD_FILE"); fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  [ -n "$password" ] || { echo "POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE is required" >&2; exit 1; }
  pwfile=$(mktemp); printf '%s\n' "$password" > "$pwfile"
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust \
    --auth-host=scram-sha-256 -E UTF8 >/dev/null
  rm -f "$pwfile"
  echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  if [ "$db" != postgres ]; then createdb -U "$user" "$db"; fi
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  echo "docker-entrypoint: initialized $PGDATA (user $user, database $db)"
fi

if [ "${1:-}" = postgres ]; then shift; exec postgres -D "$PGDATA" "$@"; fi
exec "$@"
