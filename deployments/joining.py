"""Adding a node: a one-time join token the admin creates, and the node agent's claim.

The admin creates a token for a node name (console or API) and gets it back once, with
the command to run on the new box. The node agent (``compose/node-agent.yml``) runs
``manage.py join_node`` before its Celery worker starts: it presents the token, which
creates (or claims) the Node row with its queue ``node.<name>`` and sends a first
heartbeat. Only the token's HMAC (with the key pepper, as for API keys) is stored. A token
expires unless used; once used it stays bound to its node, so the agent can restart with
the same environment, and it stops working when the node is deleted.
"""

import hmac
import re
import secrets
import shlex
import string
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from core.errors import Conflict
from deployments.choices import NodeStatus
from deployments.models import JoinToken, Node
from tenants.audit import Actor, record
from tenants.choices import AuditAction
from tenants.keys import hash_key

KIND = "tgj"
_TOKEN_RE = re.compile(r"^tgj-([a-z0-9]{8})-([A-Za-z0-9]{40})$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


@dataclass(frozen=True)
class IssuedJoinToken:
    """A new join token: the plaintext and the command exist only in this object."""

    token: str
    node_name: str
    expires_at: datetime
    command: str


def join_command(token: str, node_name: str, control_plane: str) -> str:
    """The shell command an admin runs on the new box (in a checkout of Tollgate)."""
    env = {
        "TOLLGATE_JOIN_TOKEN": token,
        "TOLLGATE_NODE_NAME": node_name,
        "TOLLGATE_CONTROL_PLANE": control_plane or "<control-plane address>",
    }
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"{assignments} docker compose -f compose/node-agent.yml --env-file node-agent.env up -d"


@transaction.atomic
def create_join_token(actor: Actor, node_name: str, control_plane: str = "") -> IssuedJoinToken:
    """A token that lets one new node join as ``node_name`` (shown once, expiring)."""
    if not _NAME_RE.match(node_name):
        raise ValidationError({"node_name": "Lower-case letters, digits and -, at most 63."})
    if Node.objects.filter(name=node_name, join_tokens__used_at__isnull=False).exists():
        raise Conflict({"node_name": f"A node named {node_name} has joined already."})
    prefix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    secret = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(40))
    token = f"{KIND}-{prefix}-{secret}"
    expires_at = timezone.now() + timedelta(hours=settings.TOLLGATE_JOIN_TOKEN_HOURS)
    user = actor if actor is not None and getattr(actor, "is_authenticated", False) else None
    row = JoinToken.objects.create(
        prefix=prefix,
        secret_hash=hash_key(token),
        node_name=node_name,
        expires_at=expires_at,
        created_by=user,
    )
    record(actor, AuditAction.CREATE, row, changes={"node_name": node_name, "prefix": prefix})
    return IssuedJoinToken(
        token, node_name, expires_at, join_command(token, node_name, control_plane)
    )


def _verify(token: str) -> JoinToken | None:
    match = _TOKEN_RE.match(token.strip())
    row = (
        JoinToken.objects.select_for_update().filter(prefix=match.group(1)).first()
        if match
        else None
    )
    # Same work whether or not the prefix exists: timing tells nothing.
    ok = hmac.compare_digest(hash_key(token.strip()), row.secret_hash if row else "0" * 64)
    return row if ok and row is not None else None


@transaction.atomic
def claim_node(token: str, name: str, **fields: Any) -> Node:
    """The node agent's join: check the token, create or update the Node row, mark it online.

    ``fields``: docker_url, engine_host, high_speed_interface, high_speed_address,
    unified_memory. Refuses (ValidationError) an unknown, expired or foreign token.
    """
    row = _verify(token)
    refused = ValidationError({"token": "The join token is unknown, expired or for another node."})
    if row is None or row.node_name != name:
        raise refused
    if row.used_at is None and row.expires_at < timezone.now():
        raise refused
    if row.used_at is not None and row.node_id is None:
        raise refused  # its node was deleted: the token went with it
    node = Node.objects.filter(name=name).first()
    fields = {k: v for k, v in fields.items() if v is not None}
    if node is None:
        node = Node(name=name, queue=f"node.{name}", **fields)
    else:
        for key, value in fields.items():
            setattr(node, key, value)
        if node.status == NodeStatus.UNREACHABLE:
            node.status = NodeStatus.ONLINE
    node.full_clean()
    node.save()
    JoinToken.objects.filter(pk=row.pk).update(used_at=row.used_at or timezone.now(), node=node)
    if row.used_at is None:
        record(None, AuditAction.UPDATE, node, changes={"joined_with": row.prefix})
    return node


def revoke_join_token(actor: Actor, row: JoinToken) -> None:
    """Withdraw an unused token."""
    record(actor, AuditAction.DELETE, row, changes={"node_name": row.node_name})
    row.delete()
