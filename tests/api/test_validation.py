"""Bad input is a 400 (a taken name or a forbidden state change a 409) problem naming the
field, and nothing is written.

Each row: who sends it, the route and method, whose object, the body, and the field the
answer must name. The database must be exactly as before afterwards (a service that saves
and then refuses must roll back).
"""

from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from metering import services as metering_services
from tests.api.conftest import Call, World, db_state, expected

PAST = lambda: (timezone.now() - timedelta(days=1)).isoformat()  # noqa: E731
HOUR_AGO = lambda: (timezone.now() - timedelta(hours=1)).isoformat()  # noqa: E731
FIXED_FUTURE = "2031-01-01T00:00:00Z"


def key_body(**extra: Any) -> Callable[[World], dict[str, Any]]:
    return lambda w: {"tenant": "acme", "name": "ci", **extra}


def price_body(**extra: Any) -> Callable[[World], dict[str, Any]]:
    return lambda w: {
        "model": "qwen3-8b",
        "input_per_mtok": "0.10",
        "output_per_mtok": "0.30",
        **extra,
    }


def deployment_body(**extra: Any) -> Callable[[World], dict[str, Any]]:
    return lambda w: {
        "name": "qwen-two",
        "model": "qwen3-8b",
        "node": "spark-1",
        "image": "vllm/vllm-openai:v0.11.0",
        **extra,
    }


def model_body(**extra: Any) -> Callable[[World], dict[str, Any]]:
    return lambda w: {
        "served_name": "llama-8b",
        "source": "meta-llama/Llama-3.1-8B",
        "params_billions": "8",
        "context_length": 8192,
        **extra,
    }


def tenant_body(**extra: Any) -> Callable[[World], dict[str, Any]]:
    return lambda w: {"name": "Charlie Co", "slug": "charlie", **extra}


def user_body(**extra: Any) -> Callable[[World], dict[str, Any]]:
    return lambda w: {"username": "erin", "email": "erin@example.test", **extra}


ALICE_KEY = lambda w: w.alice_key.pk  # noqa: E731
ALICE_MEMBERSHIP = lambda w: w.alice_membership.pk  # noqa: E731
DEPLOYMENT = lambda w: w.deployment.name  # noqa: E731

# (who, call, field the answer names)
CASES = [
    # Keys: limits never looser than the tenant's (600 rpm, 1M tpm, 32 concurrent).
    (
        "alice",
        Call("apikey-list", "POST", 400, body=key_body(requests_per_minute=601)),
        "requests_per_minute",
    ),
    (
        "alice",
        Call("apikey-list", "POST", 400, body=key_body(tokens_per_minute=1_000_001)),
        "tokens_per_minute",
    ),
    (
        "alice",
        Call("apikey-list", "POST", 400, body=key_body(max_concurrent_requests=33)),
        "max_concurrent_requests",
    ),
    (
        "alice",
        Call("apikey-list", "POST", 400, body=key_body(requests_per_minute=-1)),
        "requests_per_minute",
    ),
    (
        "alice",
        Call("apikey-detail", "PATCH", 400, ALICE_KEY, lambda w: {"tokens_per_minute": 2_000_000}),
        "tokens_per_minute",
    ),
    (
        "alice",
        Call(
            "apikey-list",
            "POST",
            400,
            body=lambda w: {"tenant": "acme", "name": "ci", "expires_at": PAST()},
        ),
        "expires_at",
    ),
    (
        "alice",
        Call("apikey-list", "POST", 400, body=key_body(allowed_models=["no-such-model"])),
        "allowed_models",
    ),
    (
        "alice",
        Call("apikey-list", "POST", 400, body=key_body(allowed_models=["bravo-private-7b"])),
        "allowed_models",
    ),
    (
        "alice",
        Call(
            "apikey-detail",
            "PATCH",
            400,
            ALICE_KEY,
            lambda w: {"allowed_models": ["bravo-private-7b"]},
        ),
        "allowed_models",
    ),
    (
        "alice",
        Call("apikey-detail", "PATCH", 400, ALICE_KEY, lambda w: {"tenant": "bravo"}),
        "tenant",
    ),
    ("alice", Call("apikey-list", "POST", 400, body=lambda w: {"tenant": "acme"}), "name"),
    ("alice", Call("apikey-list", "POST", 400, body=lambda w: {"name": "ci"}), "tenant"),
    # Members: one tenant admin always remains; roles and users must exist; no duplicates.
    (
        "alice",
        Call("membership-detail", "PATCH", 409, ALICE_MEMBERSHIP, lambda w: {"role": "member"}),
        "role",
    ),
    ("alice", Call("membership-detail", "DELETE", 409, ALICE_MEMBERSHIP), "role"),
    (
        "alice",
        Call(
            "membership-list",
            "POST",
            409,
            body=lambda w: {"tenant": "acme", "user": "bob", "role": "admin"},
        ),
        "user",
    ),
    (
        "alice",
        Call(
            "membership-list",
            "POST",
            400,
            body=lambda w: {"tenant": "acme", "user": "dave", "role": "owner"},
        ),
        "role",
    ),
    (
        "alice",
        Call(
            "membership-list",
            "POST",
            400,
            body=lambda w: {"tenant": "acme", "user": "nobody", "role": "member"},
        ),
        "user",
    ),
    # Tenants.
    ("root", Call("tenant-list", "POST", 409, body=tenant_body(slug="acme")), "slug"),
    ("root", Call("tenant-list", "POST", 400, body=tenant_body(slug="Not a slug!")), "slug"),
    ("root", Call("tenant-list", "POST", 400, body=tenant_body(currency="usd")), "currency"),
    ("root", Call("tenant-list", "POST", 400, body=tenant_body(currency="EURO")), "currency"),
    ("root", Call("tenant-list", "POST", 400, body=tenant_body(priority="P9")), "priority"),
    ("root", Call("tenant-list", "POST", 400, body=tenant_body(quota_amount="-5")), "quota_amount"),
    (
        "root",
        Call("tenant-list", "POST", 400, body=tenant_body(requests_per_minute=-1)),
        "requests_per_minute",
    ),
    (
        "root",
        Call("tenant-list", "POST", 400, body=tenant_body(allowed_models=["no-such"])),
        "allowed_models",
    ),
    (
        "root",
        Call("tenant-detail", "PATCH", 409, lambda w: "acme", lambda w: {"slug": "bravo"}),
        "slug",
    ),
    # Users: Django's password validators apply.
    ("root", Call("user-list", "POST", 400, body=user_body(password="123")), "password"),
    ("root", Call("user-list", "POST", 400, body=user_body(password="password")), "password"),
    (
        "root",
        Call("user-list", "POST", 400, body=user_body(password="erin@example.test")),
        "password",
    ),
    (
        "root",
        Call("user-detail", "PATCH", 400, lambda w: w.bob.pk, lambda w: {"password": "12345678"}),
        "password",
    ),
    (
        "root",
        Call(
            "user-list",
            "POST",
            409,
            body=user_body(username="alice", password="a long enough passphrase 9"),
        ),
        "username",
    ),
    # Prices: never negative, never backdated, ISO currency, a model that exists.
    (
        "root",
        Call("price-list", "POST", 400, body=price_body(input_per_mtok="-0.01")),
        "input_per_mtok",
    ),
    (
        "root",
        Call("price-list", "POST", 400, body=price_body(output_per_mtok="-1")),
        "output_per_mtok",
    ),
    (
        "root",
        Call("price-list", "POST", 400, body=price_body(cached_input_per_mtok="-1")),
        "cached_input_per_mtok",
    ),
    (
        "root",
        Call(
            "price-list",
            "POST",
            400,
            body=lambda w: {**price_body()(w), "effective_from": HOUR_AGO()},
        ),
        "effective_from",
    ),
    ("root", Call("price-list", "POST", 400, body=price_body(currency="usd")), "currency"),
    ("root", Call("price-list", "POST", 400, body=price_body(currency="US")), "currency"),
    ("root", Call("price-list", "POST", 400, body=price_body(currency="DOLLARS")), "currency"),
    ("root", Call("price-list", "POST", 400, body=price_body(model="no-such-model")), "model"),
    (
        "root",
        Call("price-list", "POST", 409, body=price_body(effective_from=FIXED_FUTURE)),
        "effective_from",
    ),  # a version starting at that moment exists already (see fixture)
    # Deployments: engine flags from the allow-list only, allowed images only.
    (
        "root",
        Call(
            "deployment-list",
            "POST",
            400,
            body=deployment_body(engine_args={"--api-key": "sk-123"}),
        ),
        "engine_args",
    ),
    (
        "root",
        Call("deployment-list", "POST", 400, body=deployment_body(engine_args={"host": "0.0.0.0"})),
        "engine_args",
    ),
    (
        "root",
        Call(
            "deployment-list", "POST", 400, body=deployment_body(engine_args={"--made-up-flag": 1})
        ),
        "engine_args",
    ),
    (
        "root",
        Call(
            "deployment-list",
            "POST",
            400,
            body=deployment_body(engine_args={"trust-remote-code": True}),
        ),
        "engine_args",
    ),
    (
        "root",
        Call("deployment-list", "POST", 400, body=deployment_body(engine_args={"max-num-seqs": 0})),
        "engine_args",
    ),
    (
        "root",
        Call(
            "deployment-list",
            "POST",
            400,
            body=deployment_body(engine_args=["--max-num-seqs", "4"]),
        ),
        "engine_args",
    ),
    (
        "root",
        Call(
            "deployment-list",
            "POST",
            400,
            body=deployment_body(image="docker.io/evil/miner:latest"),
        ),
        "image",
    ),
    (
        "root",
        Call("deployment-list", "POST", 400, body=deployment_body(image="vllm/vllm-openai")),
        "image",
    ),
    (
        "root",
        Call("deployment-list", "POST", 400, body=deployment_body(model="no-such-model")),
        "model",
    ),
    (
        "root",
        Call("deployment-list", "POST", 400, body=deployment_body(node="no-such-node")),
        "node",
    ),
    ("root", Call("deployment-list", "POST", 400, body=deployment_body(replicas=17)), "replicas"),
    ("root", Call("deployment-list", "POST", 409, body=deployment_body(name="qwen-main")), "name"),
    (
        "root",
        Call(
            "deployment-detail",
            "PATCH",
            400,
            DEPLOYMENT,
            lambda w: {"engine_args": {"--port": 9000}},
        ),
        "engine_args",
    ),
    (
        "root",
        Call("deployment-detail", "PATCH", 400, DEPLOYMENT, lambda w: {"image": "ubuntu:24.04"}),
        "image",
    ),
    # Catalogue models and grants.
    (
        "root",
        Call("catalogmodel-list", "POST", 400, body=model_body(served_name="bad name!")),
        "served_name",
    ),
    (
        "root",
        Call("catalogmodel-list", "POST", 409, body=model_body(served_name="qwen3-8b")),
        "served_name",
    ),
    (
        "root",
        Call("catalogmodel-list", "POST", 400, body=model_body(source="../../etc/passwd")),
        "source",
    ),
    (
        "root",
        Call("catalogmodel-list", "POST", 400, body=model_body(context_length=1)),
        "context_length",
    ),
    (
        "root",
        Call("catalogmodel-list", "POST", 400, body=model_body(visibility="secret")),
        "visibility",
    ),
    (
        "root",
        Call(
            "catalogmodel-grant",
            "POST",
            409,
            lambda w: w.private_model_a.pk,
            lambda w: {"tenant": "acme"},
        ),
        "tenant",
    ),
    (
        "root",
        Call(
            "catalogmodel-grant",
            "POST",
            400,
            lambda w: w.private_model_a.pk,
            lambda w: {"tenant": "no-such-tenant"},
        ),
        "tenant",
    ),
    # Nodes.
    (
        "root",
        Call(
            "node-list",
            "POST",
            400,
            body=lambda w: {"name": "not a slug", "docker_url": "tcp://x:2375"},
        ),
        "name",
    ),
    (
        "root",
        Call(
            "node-list",
            "POST",
            409,
            body=lambda w: {"name": "spark-1", "docker_url": "tcp://x:2375"},
        ),
        "name",
    ),
    # Admin tokens.
    (
        "alice",
        Call("admintoken-list", "POST", 400, body=lambda w: {"name": "t", "expires_at": PAST()}),
        "expires_at",
    ),
    ("root", Call("admintoken-list", "POST", 400, body=lambda w: {}), "name"),
]


@pytest.mark.parametrize(
    ("who", "call", "field"), CASES, ids=[f"{c[1].id} {c[2]} #{i}" for i, c in enumerate(CASES)]
)
def test_bad_input_is_a_problem_naming_the_field_and_nothing_is_written(
    who: str, call: Call, field: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    metering_services.set_price(
        None,
        world.public_model,
        Decimal("1"),
        None,
        Decimal("2"),
        effective_from=timezone.datetime.fromisoformat(FIXED_FUTURE),
    )
    client = client_for(getattr(world, who))
    before = db_state()
    response = call.send(client, world)
    assert response.status_code in expected(call.status), response.content[:300]
    assert response["Content-Type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == response.status_code
    # The field is named in the problem's errors, or (for a check across fields) in the
    # message of an error about the request as a whole.
    messages = [e["message"] for e in problem["errors"] if e["field"] == field]
    if not messages:
        messages = [e["message"] for e in problem["errors"] if e["field"] is None]
        assert any(field in m for m in messages), problem
    assert messages and all(isinstance(m, str) and m.strip() for m in messages), problem
    assert db_state() == before
