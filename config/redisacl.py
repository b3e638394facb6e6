"""Redis ACL users of the appliance, one per process role, written by the ``keygen`` service
into the state volume (``redis/users.acl``, passwords only as SHA-256 hashes) and loaded by
Redis (``--aclfile``); ``migrate`` re-applies them with ``ACL SETUSER`` on every start, so a
Redis that kept running through an upgrade learns new users and rules too.

- ``default`` (no password): PING only, for health checks. No key, no other command.
- ``tollgate``: web, migrate and ``manage`` commands (the console, the admin API, joining and
  revoking nodes): every key and channel, no administrative command (CONFIG, DEBUG, MONITOR,
  SHUTDOWN, …) but the ACL subcommands that manage joined nodes' users.
- ``gateway``: the tenant-facing gateway service. Only Tollgate's own keys and channels —
  everything core/keyspace.py names lives under ``<TOLLGATE_REDIS_PREFIX>:`` (so do Django's
  cache entries) — plus what queuing a Batch API job or a request's demand (an adapter load,
  an on-demand start) takes: the batch and demand queues and their Celery bindings. It
  cannot queue deploys or node work or run dangerous commands (FLUSHALL, KEYS, …).
- ``worker``: the Celery worker (deployments, telemetry, the usage safety net, the gateway's
  housekeeping: it touches every ``<prefix>:`` key). Its Celery queues (control, the
  gateway's demands, joined nodes, ``node.*``, and the batch queue, where it requeues
  batches whose runner died), Celery's bookkeeping (unacked messages, remote control for
  its health check); and, as the process whose periodic pass restores joined nodes' users
  after a Redis restart (deployments/credentials.py), the same ACL subcommands as
  ``tollgate``.
- ``beat``: Celery beat: it only queues periodic tasks on the control queue.
- ``batches``: the Batch API runner (a Celery worker on the batch queue): that queue, its own
  unacked-message keys (``unacked.<batch queue>``), remote control, and the gateways'
  invalidation channel (it issues and revokes the child keys batch requests use). No other key.
- ``usage``: the usage consumer: only the usage stream, with the stream commands of its
  consumer group (metering/ingest.py). It cannot append to, delete or read anything else.
- ``<prefix>-node-<name>``: one per joined node, not in this file: the control plane creates
  it at join and deletes it on revocation (deployments/credentials.py), and the worker
  restores it after a Redis restart. It may touch only ``<prefix>:node:<name>:*``.

Run as ``python3 -m config.redisacl <secrets dir> <acl file>`` (no Django needed), or as
``python3 -m config.redisacl --apply <secrets dir>`` to apply the users to the running Redis
at ``REDIS_URL``. Each role's password is the file ``PASSWORD_FILES[role]`` in the secrets dir.
"""

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keygen runs this file as a script, where config/logging.py shadows logging
    import redis

# Redis ACL categories: everything but server administration and what is flagged dangerous
# (FLUSHALL, KEYS, CONFIG, CLIENT KILL, …). Node users are made and removed by web (join,
# revoke) and restored by the worker; ACL SETUSER can grant anything, so only those two get it.
MANAGE_NODE_USERS = "+acl|setuser +acl|deluser +acl|getuser +acl|users"
CONTROL_PLANE = f"+@all -@admin {MANAGE_NODE_USERS}"
SAFE = "+@all -@admin -@dangerous"
# The usage consumer's commands (metering/ingest.py), and the connection's own (AUTH, HELLO,
# SELECT, CLIENT SETINFO, … but not CLIENT KILL/LIST, which are admin).
USAGE = (
    "-@all +@connection -@admin -@dangerous +ping +xgroup|create +xreadgroup +xautoclaim"
    " +xack +xinfo|groups +xpending +xtrim"
)
# kombu.transport.redis: the separator between a queue's name and its priority.
PRIORITY_SEP = "\x06\x16"
# Celery's remote control (`celery inspect ping`, the worker's health check): each worker's
# mailbox queue is bound to this fanout exchange, the replies to the other.
PIDBOX_EXCHANGES = ("celery.pidbox", "reply.celery.pidbox")

PASSWORD_FILES = {
    "tollgate": "redis_password",
    "gateway": "redis_gateway_password",
    "worker": "redis_worker_password",
    "beat": "redis_beat_password",
    "batches": "redis_batches_password",
    "usage": "redis_usage_password",
}
CONTROL_QUEUE = "control"
JOINED_NODES_QUEUE = "nodes"


@dataclass(frozen=True)
class Names:
    """What the rules depend on: the key prefix, the batch queue, the Redis database and the
    queue of work the gateway asks for on a request's behalf (settings' TOLLGATE_DEMAND_QUEUE:
    adapter loads, on-demand starts)."""

    prefix: str = "tollgate"
    batch_queue: str = "batches"
    db: int = 0
    demand_queue: str = "demand"

    @classmethod
    def from_env(cls) -> "Names":
        return cls(
            os.environ.get("TOLLGATE_REDIS_PREFIX", "tollgate"),
            os.environ.get("TOLLGATE_BATCH_QUEUE", "batches"),
            demand_queue=os.environ.get("TOLLGATE_DEMAND_QUEUE", "demand"),
        )


def unacked_key(queue: str) -> str:
    """The batch runner's own hash of unacknowledged messages (settings'
    TOLLGATE_CELERY_UNACKED_KEY): kombu redelivers from it after a crash, and must find there
    only messages of queues this user may push to."""
    return f"unacked.{queue}"


def queue_patterns(*queues: str) -> list[str]:
    """A Celery queue: its list, its priority lists (the name, "\\x06\\x16" and the priority:
    Celery checks their lengths when it declares the queue) and its exchange's bindings, which
    kombu records and reads on every send."""
    patterns = []
    for queue in queues:
        patterns.append(f"~{queue}")
        if not queue.endswith("*"):
            patterns.append(f"~{queue}{PRIORITY_SEP}*")
        patterns += [f"~_kombu.binding.{queue}", f"~_kombu.binding_permanent.{queue}"]
    return patterns


def consumer_patterns(names: Names, unacked: str = "unacked") -> list[str]:
    """What a Celery worker process needs beside its queues: the hash, index and lock of
    unacknowledged messages, and remote control: reply queues, the mailboxes' bindings (their
    queues expire: kombu keeps deadlines and sweeps them), the mailbox broadcast it subscribes
    to and the heartbeat events it publishes."""
    keys = [f"~{unacked}", f"~{unacked}_index", f"~{unacked}_mutex", "~*.celery.pidbox*"]
    keys += [f"~_kombu.binding{kind}.{x}" for x in PIDBOX_EXCHANGES for kind in ("", "_permanent")]
    keys.append("~_kombu.binding_deadlines")
    # kombu's fanout topics are "/<db>.<exchange>[/<routing key>]". Workers PSUBSCRIBE to the
    # mailbox, and ACL matches a subscribed pattern literally: so the exact name.
    return [*keys, f"&/{names.db}.celery.pidbox", f"&/{names.db}.celeryev/*"]


def role_patterns(role: str, names: Names) -> list[str]:
    """Keys (``~``) and channels (``&``) a role may touch."""
    own = [f"~{names.prefix}:*", f"&{names.prefix}:*"]
    batches = names.batch_queue
    if role == "gateway":
        # Its requests ask a worker for what they wait for: an adapter's load, an on-demand
        # model's start (gateway/lora.py, gateway/demand.py).
        return [*own, *queue_patterns(batches, names.demand_queue)]
    if role == "worker":
        nodes = (JOINED_NODES_QUEUE, "node.*")
        queues = queue_patterns(CONTROL_QUEUE, names.demand_queue, *nodes, batches)
        return [*own, *queues, *consumer_patterns(names)]
    if role == "beat":
        return queue_patterns(CONTROL_QUEUE)
    if role == "batches":
        invalidate = f"&{names.prefix}:gateway:invalidate"  # core.keyspace.invalidation_channel
        consumer = consumer_patterns(names, unacked_key(batches))
        return [*queue_patterns(batches), *consumer, invalidate]
    if role == "usage":
        return [f"~{names.prefix}:usage:events"]  # core.keyspace.usage_stream
    raise ValueError(f"no Redis role {role!r}")


def role_commands(role: str) -> str:
    return {"worker": f"{SAFE} {MANAGE_NODE_USERS}", "usage": USAGE}.get(role, SAFE)


def role_rules(role: str, names: Names) -> list[str]:
    """A role user's ACL rules (after its password)."""
    if role == "tollgate":
        return ["~*", "&*", *CONTROL_PLANE.split()]
    return ["resetkeys", "resetchannels", *role_patterns(role, names), *role_commands(role).split()]


def gateway_rules(prefix: str, batch_queue: str, demand_queue: str = "demand") -> list[str]:
    """The gateway user's ACL rules (after its password)."""
    return role_rules("gateway", Names(prefix, batch_queue, demand_queue=demand_queue))


def password_hash(path: Path) -> str:
    return "#" + hashlib.sha256(path.read_text().strip().encode()).hexdigest()


def user_rules(secrets: Path, role: str, names: Names) -> list[str]:
    return ["on", password_hash(secrets / PASSWORD_FILES[role]), *role_rules(role, names)]


def acl_lines(secrets: Path, names: Names) -> list[str]:
    lines = ["user default on nopass resetkeys resetchannels -@all +ping"]
    for role in PASSWORD_FILES:
        lines.append(" ".join(["user", role, *user_rules(secrets, role, names)]))
    return lines


def write_acl_file(secrets: Path, out: Path, names: Names | None = None) -> None:
    names = names or Names.from_env()
    out.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(acl_lines(secrets, names)) + "\n")
    # Redis runs as its own user; the file holds only hashes.
    tmp.chmod(0o644)
    tmp.replace(out)


def apply_users(client: "redis.Redis", secrets: Path, names: Names | None = None) -> list[str]:
    """Create or update the role users (not ``default`` nor ``tollgate``, which this client
    is) in a running Redis, each ending exactly as the file makes it (its rules reset keys,
    channels and commands; the password and selectors are reset here). Connections stay up.
    Joined nodes' users are left alone. Returns the users applied."""
    names = names or Names.from_env()
    roles = [role for role in PASSWORD_FILES if role != "tollgate"]
    for role in roles:
        rules = ["resetpass", "clearselectors", *user_rules(secrets, role, names)]
        client.execute_command("ACL", "SETUSER", role, *rules)
    return roles


if __name__ == "__main__":
    if sys.argv[1] == "--apply":  # python3 -m config.redisacl --apply …: redis imports cleanly
        import redis

        applied = apply_users(redis.Redis.from_url(os.environ["REDIS_URL"]), Path(sys.argv[2]))
        print(f"Redis users applied: {', '.join(applied)}", file=sys.stderr)
    else:
        write_acl_file(Path(sys.argv[1]), Path(sys.argv[2]))
