"""Objects on both sides of the tenant line, and helpers the admin API tests share.

``world`` holds one of everything the API serves, owned by tenant A, tenant B or the
platform, so each table-driven test can aim a request at another tenant's object and check
both the answer and that nothing in the database moved.
"""

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from alerts import services as alert_services
from alerts.choices import Event
from alerts.models import Notice, WebhookDelivery, WebhookEndpoint
from config.api_urls import router
from deployments import adapters as adapter_services
from deployments import services as deployment_services
from deployments.choices import OperationKind, Visibility
from deployments.models import Adapter, CatalogModel, Deployment, Node, Operation
from metering import services as metering_services
from metering.models import Price, UsageEvent
from tenants import services
from tenants.models import AdminToken, ApiKey, AuditLog, Membership, Tenant

User = get_user_model()


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Argon2 is deliberately slow; these tests are about the API, not password hashing."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@dataclass
class World:
    """Everything the API serves, on both sides of the tenant line."""

    tenant_a: Tenant
    tenant_b: Tenant
    alice: AbstractBaseUser
    bob: AbstractBaseUser
    carol: AbstractBaseUser
    root: AbstractBaseUser
    dave: AbstractBaseUser  # a console user in no tenant
    alice_membership: Membership
    bob_membership: Membership
    carol_membership: Membership
    alice_key: ApiKey  # tenant A, made by its admin
    bob_key: ApiKey  # tenant A, made by the member himself
    carol_key: ApiKey  # tenant B
    alice_token: AdminToken
    public_model: CatalogModel
    private_model_a: CatalogModel
    private_model_b: CatalogModel
    public_price: Price
    private_price_a: Price
    usage_alice: UsageEvent
    usage_bob: UsageEvent
    usage_carol: UsageEvent
    audit_a: AuditLog
    audit_b: AuditLog
    node: Node
    deployment: Deployment
    operation: Operation
    adapter_a: Adapter  # tenant A's private LoRA adapter on the public model
    webhook_a: WebhookEndpoint  # tenant A's webhook endpoint
    notice_a: Notice  # a budget alert of tenant A
    delivery_a: WebhookDelivery  # the notice's delivery to tenant A's endpoint


def _usage(key: ApiKey, model: CatalogModel) -> UsageEvent:
    return UsageEvent.objects.create(
        request_id=f"req-{uuid.uuid4().hex}",
        occurred_at=timezone.now() - timedelta(minutes=5),
        tenant=key.tenant,
        api_key=key,
        model=model,
        prompt_tokens=120,
        completion_tokens=30,
        cost=Decimal("0.000150"),
    )


@pytest.fixture
def world(
    tenant_a: Tenant,
    tenant_b: Tenant,
    alice: AbstractBaseUser,
    bob: AbstractBaseUser,
    carol: AbstractBaseUser,
    root: AbstractBaseUser,
    public_model: CatalogModel,
    private_model_a: CatalogModel,
    local_node: Node,
) -> World:
    private_model_b = deployment_services.create_model(
        None,
        served_name="bravo-private-7b",
        source="bravo/private-7b",
        params_billions=Decimal("7"),
        context_length=8192,
        visibility=Visibility.PRIVATE,
    )
    deployment_services.grant_model(None, private_model_b, tenant_b)
    alice_key = services.issue_api_key(
        alice, tenant_a, name="acme-prod", requests_per_minute=100
    ).key
    bob_key = services.issue_api_key(bob, tenant_a, name="bob-notebook").key
    carol_key = services.issue_api_key(carol, tenant_b, name="bravo-prod").key
    webhook_a = alert_services.create_endpoint(
        alice, tenant_a, "https://hooks.acme.test/tollgate", [Event.BUDGET_THRESHOLD]
    ).endpoint
    notice_a = alert_services.raise_alert(
        Event.BUDGET_THRESHOLD,
        title="Acme Research used 80 % of its money quota",
        detail="8 of 10 USD",
        payload={"threshold": 80},
        tenant=tenant_a,
    )
    deployment = deployment_services.create_deployment(
        root,
        name="qwen-main",
        model=public_model,
        node=local_node,
        image="tollgate/engine-sim:latest",
        engine_args={"max-num-seqs": 4},
    )
    return World(
        tenant_a=tenant_a,
        tenant_b=tenant_b,
        alice=alice,
        bob=bob,
        carol=carol,
        root=root,
        dave=User.objects.create_user("dave", "dave@example.test", "x" * 20),
        alice_membership=Membership.objects.get(user=alice),
        bob_membership=Membership.objects.get(user=bob),
        carol_membership=Membership.objects.get(user=carol),
        alice_key=alice_key,
        bob_key=bob_key,
        carol_key=carol_key,
        alice_token=services.issue_admin_token(alice, name="alice-laptop").token,
        public_model=public_model,
        private_model_a=private_model_a,
        private_model_b=private_model_b,
        public_price=metering_services.set_price(
            None, public_model, Decimal("0.20"), None, Decimal("0.60")
        ),
        private_price_a=metering_services.set_price(
            None, private_model_a, Decimal("1.00"), Decimal("0.50"), Decimal("3.00")
        ),
        usage_alice=_usage(alice_key, private_model_a),
        usage_bob=_usage(bob_key, public_model),
        usage_carol=_usage(carol_key, public_model),
        audit_a=AuditLog.objects.filter(tenant=tenant_a).latest("id"),
        audit_b=AuditLog.objects.filter(tenant=tenant_b).latest("id"),
        node=local_node,
        deployment=deployment,
        operation=Operation.objects.create(kind=OperationKind.DEPLOY, deployment=deployment),
        adapter_a=adapter_services.create_adapter(
            alice,
            served_name="acme/support-v3",
            base=public_model,
            tenant=tenant_a,
            source="acme/support-v3-lora",
            description="Acme's support tone.",
        ),
        webhook_a=webhook_a,
        notice_a=notice_a,
        delivery_a=WebhookDelivery.objects.get(endpoint=webhook_a),
    )


# --- Requests -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One request in a table: a router route, a method, whose object, what body, what answer.

    ``target`` picks the lookup value (pk, slug, name or request_id) for detail routes;
    ``changes`` marks calls that are allowed to write (the rest must leave the DB as it was).
    """

    route: str
    method: str
    status: int | tuple[int, ...]
    target: Callable[[World], Any] | None = None
    body: Callable[[World], dict[str, Any]] | None = None
    changes: bool = False
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.method} {self.route}" + (f" ({self.note})" if self.note else "")

    def path(self, world: World) -> str:
        args = [self.target(world)] if self.target else []
        return reverse(self.route, args=args)

    def send(self, client: APIClient, world: World) -> Any:
        data = self.body(world) if self.body else None
        return client.generic(
            self.method,
            self.path(world),
            data=_json(data) if data is not None else "",
            content_type="application/json",
        )


def _json(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, default=str)


def expected(status: int | tuple[int, ...]) -> tuple[int, ...]:
    return status if isinstance(status, tuple) else (status,)


def router_endpoints() -> set[tuple[str, str]]:
    """Every (route name, HTTP method) the admin API router serves, from the router itself."""
    endpoints = set()
    for pattern in router.urls:
        callback = pattern.callback
        if pattern.name == "api-root" or "format" in pattern.pattern.regex.groupindex:
            continue
        # HEAD and OPTIONS come with GET from DRF itself (and DRF adds "head" to
        # ``actions`` lazily, on the first request), so they are not endpoints of their own.
        allowed = set(callback.cls.http_method_names) - {"head", "options"}
        endpoints |= {(pattern.name, m.upper()) for m in callback.actions if m in allowed}
    return endpoints


def router_lookup_count(route: str) -> int:
    """How many URL arguments a router route takes (0 for lists, 1 for details/actions)."""
    pattern = next(p for p in router.urls if p.name == route)
    return len(set(pattern.pattern.regex.groupindex) - {"format"})


# --- Database state ---------------------------------------------------------------------

# Columns a read bumps on its own (token use, logins); everything else must stay put.
VOLATILE = ("last_used_at", "last_login")
OWNED_PREFIXES = ("tenants_", "deployments_", "metering_", "alerts_", "auth_user")


def db_state() -> dict[str, list[str]]:
    """Every row of every Tollgate table (and users), as text, for before/after comparisons."""
    state = {}
    drop = " ".join(f"- '{column}'" for column in VOLATILE)
    with connection.cursor() as cursor:
        for table in sorted(connection.introspection.table_names()):
            if not table.startswith(OWNED_PREFIXES):
                continue
            cursor.execute(f'SELECT (to_jsonb(t) {drop})::text FROM "{table}" t ORDER BY 1')
            state[table] = [row[0] for row in cursor.fetchall()]
    return state


def all_rows_text() -> str:
    """Every row of every table in the test database, as one text blob to search."""
    chunks = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT t::text FROM "{table}" t')
            chunks += [row[0] for row in cursor.fetchall()]
    return "\n".join(chunks)
