"""Joined nodes' credentials: one Redis ACL user per node, limited to the node's own keys.

A node that joins with its one-time token gets a password once (the agent keeps it in its
state volume); the control plane keeps only its SHA-256, which is what Redis itself stores
(``ACL SETUSER … #<sha256>``) and compares. The user may touch only
``<prefix>:node:<name>:*`` with the few commands the agent's relay needs, so a node's
credential reads nothing of another node's, of any tenant's or of the control plane's.
Users are (re)applied after every join and on each periodic pass (a restarted Redis loads
only its ACL file) and deleted on revocation — Redis then drops the agent's connections.
"""

import hashlib
import logging
import secrets

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from redis.exceptions import ResponseError

from core.errors import Conflict
from core.redis import get_redis
from deployments import fleet, relay
from deployments.choices import NodeStatus
from deployments.models import Node
from tenants.audit import Actor, record
from tenants.choices import AuditAction

log = logging.getLogger(__name__)

PREFIX = "tgn"
# What the agent does: pop requests, push replies (with a TTL), set its facts; PING for
# the connection's health checks. Nothing else: no KEYS/SCAN, no pub/sub, no admin.
COMMANDS = ["-@all", "+ping", "+brpop", "+rpush", "+expire", "+set"]


def acl_user(name: str) -> str:
    return f"{settings.TOLLGATE_REDIS_PREFIX}-node-{name}"


def password_hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def acl_rules(name: str, digest: str) -> list[str]:
    """``ACL SETUSER`` rules for the node's user; ``reset`` first so re-applying is exact."""
    return ["reset", "on", f"#{digest}", f"~{relay.key_base(name)}:*", "resetchannels", *COMMANDS]


def issue_credential(node: Node) -> str:
    """A new password for the node (returned once; only its SHA-256 is kept)."""
    password = f"{PREFIX}-{secrets.token_urlsafe(32)}"
    Node.objects.filter(pk=node.pk).update(
        credential_hash=password_hash(password), credential_issued_at=timezone.now()
    )
    node.refresh_from_db()
    transaction.on_commit(lambda: apply_acl_user(node))
    return password


def apply_acl_user(node: Node) -> None:
    rules = acl_rules(node.name, node.credential_hash)
    get_redis().execute_command("ACL", "SETUSER", acl_user(node.name), *rules)


def _has_user(node: Node) -> bool:
    """The user is there with this password (re-applying would be a no-op, so skip it)."""
    user = get_redis().acl_getuser(acl_user(node.name))
    return bool(user) and node.credential_hash in user.get("passwords", [])


def delete_acl_user(name: str) -> None:
    """Delete the user; Redis closes every connection authenticated as it."""
    get_redis().execute_command("ACL", "DELUSER", acl_user(name))


def sync_acl_users() -> int:
    """Re-apply every live node credential (Redis restarts load only the ACL file) and
    delete revoked ones; returns how many users were applied."""
    applied = 0
    try:
        live = list(Node.objects.exclude(credential_hash="").exclude(status=NodeStatus.REVOKED))
        for node in live:
            if not _has_user(node):
                apply_acl_user(node)
                applied += 1
        # Users of revoked or deleted nodes go (this installation's prefix only).
        keep = {acl_user(node.name) for node in live}
        for user in get_redis().acl_users():
            name = user.decode() if isinstance(user, bytes) else user
            if name.startswith(acl_user("")) and name not in keep:
                get_redis().acl_deluser(name)
    except ResponseError as exc:
        log.warning("cannot manage joined nodes' Redis users: %s", exc)
    return applied


def revoke_node(actor: Actor, node: Node) -> Node:
    """Cut a node off: its Redis user goes (its agent's connections drop within the
    second), it is marked revoked, and its replicas leave routing at once."""
    if not relay.is_relayed(node.docker_url):
        raise Conflict({"name": f"{node.name} runs its own worker: it holds no credential."})
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(
            status=NodeStatus.REVOKED, revoked_at=timezone.now(), credential_hash=""
        )
        record(actor, AuditAction.UPDATE, node, changes={"status": NodeStatus.REVOKED})
    delete_acl_user(node.name)
    fleet.drain_node(node, f"node {node.name}: its credential was revoked")
    node.refresh_from_db()
    return node
