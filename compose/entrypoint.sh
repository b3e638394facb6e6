#!/bin/bash
# Entry point of the Tollgate image. One image, one role per container:
#
#   keygen    generate the stack's secrets into the state volume when none are given
#   migrate   migrate, bootstrap (first admin, local node), seed the demo on first start
#   web       gunicorn + uvicorn workers: console, admin API, /v1 gateway, /healthz
#   gateway   the same server for /v1, as the database's least-privilege gateway role
#   worker    Celery worker for the control queue, the gateway's demands and this node's queue
#   beat      Celery beat (periodic reconcile, telemetry, usage safety net, rollups)
#   usage     usage consumer: Redis stream -> PostgreSQL (`usage export …`: the command line)
#   janitor   idle; on SIGTERM (compose down/stop) remove this stack's engine containers
#   docker-policy  the Docker API policy on :2375 (the docker-proxy service; needs no secret)
#   stop-engines  remove this stack's engine containers now
#   worker-ping   health check of the worker (answers Celery's ping within 10 s)
#   manage …  any manage.py command
#   login, logout, tenants, keys, models, prices, deployments, usage …
#             the admin command line (tollgate_cli; docs/reference/cli.md), speaking the
#             admin API at TOLLGATE_URL (default http://127.0.0.1:8000, this container's web)
#   anything else is executed as given
#
# Secrets: DJANGO_SECRET_KEY, TOLLGATE_KEY_PEPPER and DATABASE_URL (or their _FILE) win when
# set. Otherwise the secret key, the key pepper and the database password are read from the
# state volume
# ($TOLLGATE_STATE_DIR/secrets), where the `keygen` role created them on first start.
#
# TOLLGATE_IDENTITY (set per service in docker-compose.yml) says whose credentials this
# process uses: owner (default: migrate, keygen), web, gateway, worker, beat, batches or usage.
# Only the owner holds the database owner's password (a superuser of the bundled database).
# The others connect to PostgreSQL as a role that cannot change the schema (config/dbroles.py;
# beat has no database); each but web has its own Redis ACL user (config/redisacl.py; web is
# the control plane's `tollgate` user), and each service mounts only its own secrets volume
# (/var/lib/tollgate-<identity> in keygen), not the state volume.
set -euo pipefail

STATE_DIR=${TOLLGATE_STATE_DIR:-/var/lib/tollgate}
SECRETS_DIR=$STATE_DIR/secrets
# Written by keygen for the gateway service and for Redis (their own volumes).
GATEWAY_STATE_DIR=${TOLLGATE_GATEWAY_STATE_DIR:-/var/lib/tollgate-gateway}
REDIS_ACL_DIR=${TOLLGATE_REDIS_ACL_DIR:-/var/lib/tollgate-redis}
# The processes with their own Redis user (and secrets volume).
ROLES="gateway worker beat batches usage"
# What each secrets volume holds.
declare -A ROLE_SECRETS=(
  # The console and admin API: the control plane's Redis user, the application database role.
  [web]="secret_key key_pepper app_db_password redis_password"
  [gateway]="secret_key key_pepper gateway_db_password redis_gateway_password"
  # The application database role's password (rows, never the schema), not the owner's.
  [worker]="secret_key key_pepper app_db_password redis_worker_password"
  # Beat only queues tasks: no database at all (docker-compose.yml gives it a placeholder URL).
  [beat]="secret_key redis_beat_password"
  [batches]="secret_key key_pepper app_db_password redis_batches_password"
  [usage]="secret_key key_pepper app_db_password redis_usage_password"
  # Removes the stack's engines when it stops: Docker through the policy, no database or Redis.
  [janitor]="secret_key"
)

log() { printf '%s tollgate-entrypoint %s\n' "$(date -u +%FT%TZ)" "$*" >&2; }

# Creates $1 with a fresh random value unless it exists; concurrent callers agree on one
# value (the file is linked into place, which fails when another got there first).
generate_secret() {
  python3 - "$1" "$2" <<'PY'
import os, secrets, sys, tempfile
path, nbytes = sys.argv[1], int(sys.argv[2])
if os.path.exists(path):
    sys.exit(0)
os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
with os.fdopen(fd, "w") as f:
    f.write(secrets.token_urlsafe(nbytes) + "\n")
# The database server runs as another user and must read its password file.
os.chmod(tmp, 0o644 if path.endswith("postgres_password") else 0o600)
try:
    os.link(tmp, path)
    print(f"generated {path}", file=sys.stderr)
except FileExistsError:
    pass
finally:
    os.unlink(tmp)
PY
}

wait_for_file() {
  for _ in $(seq 1 60); do [ -s "$1" ] && return 0; sleep 1; done
  log "$1 is missing: did the 'keygen' service run?"; return 1
}

# The database role of a process that is not the owner (config/dbroles.py): the gateway's
# (reads everything, writes only batches and keys' last use) and the application role of the
# console (web), the worker, the batch runner and the usage consumer (rows, never the schema).
# From TOLLGATE_<KIND>_DATABASE_URL (or its _FILE), else, with the bundled database, the
# password keygen generated; with a database of your own and no such URL, DATABASE_URL's.
#   use_role_database GATEWAY tollgate_gateway gateway_db_password
use_role_database() {
  local url_var=TOLLGATE_$1_DATABASE_URL file_var=TOLLGATE_$1_DATABASE_URL_FILE user=$2
  local password_file=$SECRETS_DIR/$3 url=""
  if [ -n "${!file_var:-}" ]; then
    if [ ! -r "${!file_var}" ]; then
      log "$file_var='${!file_var}' cannot be read (is it mounted into the ${TOLLGATE_IDENTITY} service?)"
      return 1
    fi
    url=$(tr -d '\r\n' < "${!file_var}")
  elif [ -n "${!url_var:-}" ]; then
    url=${!url_var}
  fi
  unset "$url_var" "$file_var"
  if [ -n "$url" ]; then
    DATABASE_URL=$url
    # The owner's URL from a file would win over DATABASE_URL (config/env.py): drop it.
    unset DATABASE_URL_FILE
  elif [ -z "${DATABASE_URL:-}" ] && [ -z "${DATABASE_URL_FILE:-}" ]; then
    wait_for_file "$password_file"
    DATABASE_URL="postgres://$user:$(cat "$password_file")@${POSTGRES_HOST:-db}:${POSTGRES_PORT:-5432}/${POSTGRES_DB:-tollgate}"
  fi
  if [ -n "${DATABASE_URL:-}" ]; then export DATABASE_URL; fi
}

load_secrets() {
  case "${TOLLGATE_IDENTITY:-owner}" in
    gateway) use_role_database GATEWAY "${TOLLGATE_GATEWAY_DB_USER:-tollgate_gateway}" gateway_db_password ;;
    web|worker|batches|usage) use_role_database APP "${TOLLGATE_APP_DB_USER:-tollgate_app}" app_db_password ;;
  esac
  if [ -z "${DJANGO_SECRET_KEY:-}" ] && [ -z "${DJANGO_SECRET_KEY_FILE:-}" ]; then
    wait_for_file "$SECRETS_DIR/secret_key"
    export DJANGO_SECRET_KEY_FILE=$SECRETS_DIR/secret_key
  fi
  if [ -z "${TOLLGATE_KEY_PEPPER:-}" ] && [ -z "${TOLLGATE_KEY_PEPPER_FILE:-}" ] \
     && [ -s "$SECRETS_DIR/key_pepper" ]; then
    export TOLLGATE_KEY_PEPPER_FILE=$SECRETS_DIR/key_pepper
  fi
  # The earlier default (no credentials), kept in many .env files, means the bundled Redis.
  if [ "${REDIS_URL:-}" = redis://redis:6379/0 ]; then unset REDIS_URL; fi
  if [ -z "${REDIS_URL:-}" ] && [ -z "${REDIS_URL_FILE:-}" ]; then
    # The bundled Redis, as this process's ACL user (config/redisacl.py).
    local user=tollgate password_file=$SECRETS_DIR/redis_password
    case "${TOLLGATE_IDENTITY:-owner}" in
      owner|web) ;;
      gateway|worker|beat|batches|usage)
        user=$TOLLGATE_IDENTITY password_file=$SECRETS_DIR/redis_${TOLLGATE_IDENTITY}_password ;;
      *) log "unknown TOLLGATE_IDENTITY=$TOLLGATE_IDENTITY (owner, web, $ROLES)"; return 1 ;;
    esac
    wait_for_file "$password_file"
    REDIS_URL="redis://$user:$(cat "$password_file")@${REDIS_HOST:-redis}:${REDIS_PORT:-6379}/0"
    export REDIS_URL
  fi
  if [ -z "${DATABASE_URL:-}" ] && [ -z "${DATABASE_URL_FILE:-}" ]; then
    local password_file=${POSTGRES_PASSWORD_FILE:-$SECRETS_DIR/postgres_password}
    wait_for_file "$password_file"
    DATABASE_URL="postgres://${POSTGRES_USER:-tollgate}:$(cat "$password_file")@${POSTGRES_HOST:-db}:${POSTGRES_PORT:-5432}/${POSTGRES_DB:-tollgate}"
    export DATABASE_URL
  fi
}

role_keygen() {
  # A fresh stack also gets its own API-key pepper, so that rotating the secret key later
  # keeps every API key valid. An existing stack keeps hashing as before (no pepper file):
  # a new pepper would invalidate its keys.
  if [ ! -e "$SECRETS_DIR/secret_key" ]; then
    generate_secret "$SECRETS_DIR/key_pepper" 48
  fi
  generate_secret "$SECRETS_DIR/secret_key" 48
  if [ -z "${POSTGRES_PASSWORD_FILE:-}" ]; then
    generate_secret "$SECRETS_DIR/postgres_password" 24
  fi
  generate_secret "$SECRETS_DIR/gateway_db_password" 24
  generate_secret "$SECRETS_DIR/app_db_password" 24
  # Redis ACL users (config/redisacl.py): a password per user (the control plane's, then
  # each role's), and the ACL file Redis loads (hashes only), rewritten on every start.
  generate_secret "$SECRETS_DIR/redis_password" 24
  local role
  for role in $ROLES; do generate_secret "$SECRETS_DIR/redis_${role}_password" 24; done
  python3 /app/config/redisacl.py "$SECRETS_DIR" "$REDIS_ACL_DIR/users.acl"
  for role in "${!ROLE_SECRETS[@]}"; do share_with "$role"; done
}

# Each role's service mounts only its own volume (<role>-secrets, here at
# /var/lib/tollgate-<role>): the secrets it needs, copied there on every start; not the other
# roles' Redis passwords, and never the owner's database password.
share_with() {
  local role=$1 dir name
  if [ "$role" = gateway ]; then dir=$GATEWAY_STATE_DIR/secrets; else dir=/var/lib/tollgate-$role/secrets; fi
  mkdir -p "$dir"
  for name in ${ROLE_SECRETS[$role]}; do
    if [ -e "$SECRETS_DIR/$name" ]; then
      install -m 600 "$SECRETS_DIR/$name" "$dir/$name"
    fi
  done
  # What the role no longer uses goes (e.g. the owner's database password, copied to the
  # worker, batches and usage volumes before they had the application role).
  local path
  for path in "$dir"/*; do
    [ -e "$path" ] || continue
    case " ${ROLE_SECRETS[$role]} " in
      *" ${path##*/} "*) ;;
      *) rm -f "$path" ;;
    esac
  done
}

role_migrate() {
  local bundled_db=0
  if [ -z "${DATABASE_URL:-}" ] && [ -z "${DATABASE_URL_FILE:-}" ]; then bundled_db=1; fi
  local bundled_redis=0
  if [ -z "${REDIS_URL_FILE:-}" ] && { [ -z "${REDIS_URL:-}" ] || [ "$REDIS_URL" = redis://redis:6379/0 ]; }; then
    bundled_redis=1
  fi
  load_secrets
  python3 manage.py migrate --noinput
  # The bundled Redis: (re)apply the role users, so that one which kept running through an
  # upgrade (it reads its ACL file only when it starts) knows every user and rule keygen wrote.
  if [ $bundled_redis = 1 ]; then
    python3 -m config.redisacl --apply "$SECRETS_DIR"
  fi
  # The bundled database: (re)grant the gateway's and the application role after every
  # migration. With a database of your own, run `manage.py db_roles` yourself
  # (docs/operations/least-privilege.md).
  if [ $bundled_db = 1 ]; then
    python3 manage.py db_roles --gateway-role "${TOLLGATE_GATEWAY_DB_USER:-tollgate_gateway}" \
      --password-file "$SECRETS_DIR/gateway_db_password" \
      --app-role "${TOLLGATE_APP_DB_USER:-tollgate_app}" \
      --app-password-file "$SECRETS_DIR/app_db_password"
  fi
  python3 manage.py bootstrap
  if [ "${TOLLGATE_SEED_DEMO:-false}" = true ] && [ ! -e "$STATE_DIR/demo-seeded" ]; then
    python3 manage.py seed_demo ${TOLLGATE_DEMO_IMAGE:+--image "$TOLLGATE_DEMO_IMAGE"}
    touch "$STATE_DIR/demo-seeded"
  fi
}

role_web() {
  load_secrets
  # Prometheus multiprocess files of the web workers (made fresh by config/gunicorn.py).
  export PROMETHEUS_MULTIPROC_DIR="${PROMETHEUS_MULTIPROC_DIR:-/tmp/tollgate-metrics}"
  exec gunicorn -c python:config.gunicorn config.asgi:application \
    --workers "${TOLLGATE_WEB_WORKERS:-2}" \
    --bind "${TOLLGATE_WEB_HOST:-0.0.0.0}:${TOLLGATE_WEB_PORT:-8000}" \
    --graceful-timeout "${TOLLGATE_WEB_GRACEFUL_SECONDS:-30}" \
    --timeout 0 --keep-alive 75 \
    --forwarded-allow-ips "${TOLLGATE_FORWARDED_ALLOW_IPS:-127.0.0.1}" \
    --access-logfile - --error-logfile -
}

role_worker() {
  load_secrets
  exec celery -A config worker \
    --queues "${TOLLGATE_WORKER_QUEUES:-control,${TOLLGATE_DEMAND_QUEUE:-demand},nodes,node.${TOLLGATE_LOCAL_NODE_NAME:-local}}" \
    --concurrency "${TOLLGATE_WORKER_CONCURRENCY:-4}" \
    --hostname "worker@%h" --without-gossip --without-mingle \
    --loglevel "${TOLLGATE_LOG_LEVEL:-INFO}"
}

role_beat() {
  load_secrets
  exec celery -A config beat --schedule /run/tollgate/celerybeat-schedule \
    --loglevel "${TOLLGATE_LOG_LEVEL:-INFO}"
}

role_batches() {
  load_secrets
  # Its own unacknowledged-message keys (config/settings.py), which its Redis user may use.
  export TOLLGATE_CELERY_UNACKED_KEY=unacked.${TOLLGATE_BATCH_QUEUE:-batches}
  exec celery -A config worker \
    --queues "${TOLLGATE_BATCH_QUEUE:-batches}" \
    --concurrency "${TOLLGATE_BATCH_WORKERS:-2}" \
    --hostname "batches@%h" --without-gossip --without-mingle \
    --loglevel "${TOLLGATE_LOG_LEVEL:-INFO}"
}

role_usage() {
  load_secrets
  exec python3 manage.py consume_usage
}

role_janitor() {
  load_secrets
  exec python3 /app/compose/janitor.py "$@"
}

role=${1:-web}
[ $# -gt 0 ] && shift
case "$role" in
  keygen) role_keygen ;;
  migrate) role_migrate ;;
  web) role_web ;;
  gateway) TOLLGATE_IDENTITY=gateway role_web ;;
  worker) role_worker ;;
  beat) role_beat ;;
  # `usage` alone is the consumer role; `usage export …` is the command line's.
  usage) if [ $# -gt 0 ]; then exec python3 -m tollgate_cli usage "$@"; else role_usage; fi ;;
  batches) role_batches ;;
  janitor) role_janitor ;;
  stop-engines) role_janitor --now ;;
  docker-policy) exec python3 -m dockerpolicy "$@" ;;
  worker-ping) load_secrets; exec celery -A config inspect ping -d "worker@$HOSTNAME" --timeout 10 >/dev/null ;;
  manage) load_secrets; exec python3 manage.py "$@" ;;
  login|logout|tenants|keys|models|prices|deployments) exec python3 -m tollgate_cli "$role" "$@" ;;
  *) exec "$role" "$@" ;;
esac
