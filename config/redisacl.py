"""Redis ACL users of the appliance, written by the ``keygen`` service into the state volume
(``redis/users.acl``, passwords only as SHA-256 hashes) and loaded by Redis (``--aclfile``).

- ``default`` (no password): PING only, for health checks. No key, no other command.
- ``tollgate``: the control plane (web, worker, beat, usage consumer, batch runner): every
  key and channel, no administrative command (CONFIG, DEBUG, MONITOR, SHUTDOWN, …) but the
  ACL subcommands that manage joined nodes' users (SETUSER, DELUSER, GETUSER, USERS).
- ``<prefix>-node-<name>``: one per joined node, not in this file: the control plane
  creates it at join and deletes it on revocation (deployments/credentials.py), and
  restores it after a Redis restart (which loads only this file) on its next pass. It may
  touch only ``<prefix>:node:<name>:*`` with the few commands the node agent needs.
- ``gateway``: the tenant-facing gateway service. Only Tollgate's own keys and channels —
  everything core/keyspace.py names lives under ``<TOLLGATE_REDIS_PREFIX>:`` (so do
  Django's cache entries) — plus what queuing a Batch API job takes (the batch queue and
  Celery's queue bindings). It cannot queue deploys or node work, read other data or run
  dangerous commands (FLUSHALL, KEYS, …).

Run as ``python3 -m config.redisacl <secrets dir> <acl file>``; no Django needed. The
passwords are files in the secrets dir (``redis_password``, ``redis_gateway_password``).
"""

import hashlib
import os
import sys
from pathlib import Path

# Redis ACL categories: everything but server administration, and for the gateway also
# nothing flagged dangerous.
# Joined nodes' users are made and removed by the control plane (deployments/credentials.py).
CONTROL_PLANE = "+@all -@admin +acl|setuser +acl|deluser +acl|getuser +acl|users"
GATEWAY = "+@all -@admin -@dangerous"
# kombu.transport.redis: the separator between a queue's name and its priority.
PRIORITY_SEP = "\x06\x16"


def gateway_patterns(prefix: str, batch_queue: str) -> list[str]:
    """Keys (``~``) and channels (``&``) the gateway may touch."""
    return [
        f"~{prefix}:*",
        # Kombu's Redis transport: the queue's list, its priority lists (the name, then
        # "\x06\x16" and the priority: Celery checks their lengths when it declares the
        # queue) and the exchange bindings it records and reads (_kombu.binding*).
        f"~{batch_queue}",
        f"~{batch_queue}{PRIORITY_SEP}*",
        "~_kombu.binding*",
        f"&{prefix}:*",
    ]


def password_hash(path: Path) -> str:
    return "#" + hashlib.sha256(path.read_text().strip().encode()).hexdigest()


def gateway_rules(prefix: str, batch_queue: str) -> list[str]:
    """The gateway user's ACL rules (after its password)."""
    return ["resetkeys", "resetchannels", *gateway_patterns(prefix, batch_queue), *GATEWAY.split()]


def acl_lines(secrets: Path, prefix: str, batch_queue: str) -> list[str]:
    gateway = " ".join(gateway_rules(prefix, batch_queue))
    return [
        "user default on nopass resetkeys resetchannels -@all +ping",
        f"user tollgate on {password_hash(secrets / 'redis_password')} ~* &* {CONTROL_PLANE}",
        f"user gateway on {password_hash(secrets / 'redis_gateway_password')} {gateway}",
    ]


def write_acl_file(secrets: Path, out: Path) -> None:
    prefix = os.environ.get("TOLLGATE_REDIS_PREFIX", "tollgate")
    batch_queue = os.environ.get("TOLLGATE_BATCH_QUEUE", "batches")
    out.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(acl_lines(secrets, prefix, batch_queue)) + "\n")
    # Redis runs as its own user; the file holds only hashes.
    tmp.chmod(0o644)
    tmp.replace(out)


if __name__ == "__main__":
    write_acl_file(Path(sys.argv[1]), Path(sys.argv[2]))
