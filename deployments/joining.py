"""Adding a node: a one-time join token the admin creates, and the node agent's exchange.

The admin creates a token for a node name (console or API) and gets it back once, with
the command to run on the new box. The node agent (``nodeagent``, ``compose/node-agent.yml``)
spends it once at ``POST /api/v1/nodes/join/`` for the node's own credential
(``deployments.credentials``): the node row is created, driven by the control plane's
worker through the agent (``deployments.relay``). Only the token's HMAC (with the key
pepper, as for API keys) is stored; a token expires unless used and works once.
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
from deployments import credentials, relay
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
        "TOLLGATE_CONTROL_PLANE_URL": control_plane or "<control-plane URL>",
    }
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (
        f"{assignments} TOLLGATE_NODE_ENGINE_HOST=<this box's address> "
        "docker compose -f compose/node-agent.yml up -d"
    )


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


@dataclass(frozen=True)
class JoinedNode:
    """A node that just joined, and its credential: the password exists only here."""

    node: Node
    redis_user: str
    redis_password: str
    key_base: str


@transaction.atomic
def exchange_join_token(token: str, name: str, **fields: Any) -> JoinedNode:
    """A node agent's join: spend the one-time token, create the node (driven through its
    agent), and issue its credential. The token works once: an agent keeps its credential,
    and a node whose credential was revoked must be deleted before its name is reused."""
    row = _verify(token)
    refused = ValidationError(
        {"token": "The join token is unknown, expired, used or for another node."}
    )
    if row is None or row.node_name != name or row.used_at is not None:
        raise refused
    if row.expires_at < timezone.now():
        raise refused
    node = Node.objects.filter(name=name).first()
    if node is not None and node.status == NodeStatus.REVOKED:
        raise Conflict({"name": f"{name} was revoked: delete the node before it joins again."})
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.update(docker_url=relay.node_url(name), queue=settings.TOLLGATE_JOINED_NODE_QUEUE)
    node = node or Node(name=name)
    for key, value in fields.items():
        setattr(node, key, value)
    node.full_clean()
    node.save()
    JoinToken.objects.filter(pk=row.pk).update(used_at=timezone.now(), node=node)
    password = credentials.issue_credential(node)
    record(None, AuditAction.UPDATE, node, changes={"joined_with": row.prefix})
    return JoinedNode(node, credentials.acl_user(name), password, relay.key_base(name))
