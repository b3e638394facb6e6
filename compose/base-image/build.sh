#!/usr/bin/env bash
# Builds the local base image (default tollgate/base:bookworm) from Debian's own packages
# with debootstrap, because no image registry is reachable here. The rootfs tarball is
# cached so later runs skip debootstrap; the script is a no-op when the image exists.
#
# Environment:
#   BASE_IMAGE      image name to produce           (default tollgate/base:bookworm)
#   DEBIAN_SUITE    Debian suite                     (default bookworm)
#   DEBIAN_MIRROR   apt mirror                       (default http://deb.debian.org/debian)
#   DEBIAN_ARCH     architecture, e.g. arm64         (default this machine's; a foreign one
#                   needs qemu-user-static with binfmt_misc: scripts/ensure-services --arm64)
#   TOLLGATE_CACHE  where the rootfs tarball lives   (default $HOME/.cache/tollgate)
#   FORCE_REBUILD=1 ignore an existing image (the cached tarball is still reused)
set -euo pipefail

BASE_IMAGE=${BASE_IMAGE:-tollgate/base:bookworm}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE_DIR=${TOLLGATE_CACHE:-$HOME/.cache/tollgate}
HOST_ARCH=$(dpkg --print-architecture)
ARCH=${DEBIAN_ARCH:-$HOST_ARCH}
TARBALL="$CACHE_DIR/rootfs-$DEBIAN_SUITE-$ARCH.tar"

log() { printf '[base-image] %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

image_exists() { docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; }

WORK=""
cleanup() { if [ -n "$WORK" ]; then as_root rm -rf "$WORK"; fi; }
# The rootfs is root-owned; clean it up whatever happens.
trap cleanup EXIT

build_rootfs() {
  WORK=$(mktemp -d)
  local work=$WORK
  log "debootstrap $DEBIAN_SUITE ($ARCH) from $DEBIAN_MIRROR"
  # A foreign architecture's second stage runs its binaries through qemu (binfmt_misc).
  as_root debootstrap --arch="$ARCH" --variant=minbase --include=python3,ca-certificates \
    "$DEBIAN_SUITE" "$work/rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; return 1; }
  # Package caches and lists only make the image bigger.
  as_root rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
  mkdir -p "$CACHE_DIR"
  as_root tar -C "$work/rootfs" -cf "$TARBALL.partial" .
  as_root chown "$(id -u):$(id -g)" "$TARBALL.partial"
  # Rename last so an interrupted run never leaves a truncated tarball in the cache.
  mv "$TARBALL.partial" "$TARBALL"
}

main() {
  if [ "${FORCE_REBUILD:-0}" != 1 ] && image_exists; then
    log "$BASE_IMAGE already present"
    return 0
  fi
  if [ ! -s "$TARBALL" ]; then
    build_rootfs
  else
    log "using cached $TARBALL"
  fi
  log "importing $TARBALL as $BASE_IMAGE"
  docker import --platform "linux/$ARCH" \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$TARBALL" "$BASE_IMAGE" >/dev/null
  log "built $BASE_IMAGE"
}

main "$@"
