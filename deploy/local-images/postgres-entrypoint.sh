#!/bin/sh
# First start: create the cluster (UTF-8, as the official image makes it) with the official image's variables;
# then run the given command.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}" > "$pwfile"
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --auth-host=scram-sha-256 --auth-local=trust \
    --encoding=UTF8 --locale=C.UTF-8
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
  [ "$POSTGRES_DB" = postgres ] || createdb -U "$POSTGRES_USER" "$POSTGRES_DB"
  pg_ctl -D "$PGDATA" -m fast -w stop
fi
if [ "$1" = postgres ]; then
  shift
  exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
