"""Every field the admin API lets an admin write reaches the audit log: in the snapshot of a
created object, and in the before/after of an update that changes it.

The writable fields are read from the router's serializers themselves. A field added to a
serializer fails here until it has a sample value below, and then until the service that
writes it records it. Secrets written through the API (a user's password, an external
engine's key) are recorded as changed, never by their value.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.forms import ModelForm
from django.urls import reverse
from django.utils import timezone
from rest_framework import serializers
from rest_framework.test import APIClient

from config.api_urls import router
from console import forms as console_forms
from deployments import services as deployment_services
from deployments.models import MODEL_FIELDS, NODE_FIELDS, CatalogModel, Node
from deployments.profiles import ensure_builtin_profiles
from tenants.models import TENANT_FIELDS, AuditLog, Tenant
from tests.api.conftest import World

VIEWSETS = {basename: viewset for _, viewset, basename in router.registry}
SECRETS = {"password", "upstream_key"}


def writable(basename: str) -> set[str]:
    """Fields a JSON body writes (an uploaded file is audited as what it becomes: an
    adapter's archive as its new source, tests/api/test_adapter_uploads.py)."""
    fields = VIEWSETS[basename].serializer_class().fields
    return {
        name
        for name, f in fields.items()
        if not f.read_only and not isinstance(f, serializers.FileField)
    }


def updatable(basename: str) -> bool:
    viewset = VIEWSETS[basename]
    return "patch" in viewset.http_method_names and hasattr(viewset, "partial_update")


def later(days: int) -> str:
    return (timezone.now() + timedelta(days=days)).isoformat()


@dataclass(frozen=True)
class Resource:
    """How to create one object of a resource with every writable field given, and a new
    value for each field an update may change (applied one after the other, in order)."""

    basename: str
    create: Callable[[World], dict[str, Any]]
    changes: Callable[[World], dict[str, Any]] = lambda w: {}
    once: frozenset[str] = field(default=frozenset())  # set at creation, never changed


GIB = 2**30

RESOURCES = [
    Resource(
        "tenant",
        lambda w: {
            "name": "Audited Co",
            "slug": "audited",
            "priority": "P1",
            "requests_per_minute": 100,
            "tokens_per_minute": 10_000,
            "max_concurrent_requests": 4,
            "quota_period": "monthly",
            "quota_tokens": 100_000,
            "quota_amount": "10.0000",
            "currency": "USD",
            "alert_thresholds": [50, 90],
            "model_access": "all",
            "allowed_models": [],
            "fair_share_weight": 2,
        },
        lambda w: {
            "name": "Audited Two",
            "slug": "audited-two",
            "priority": "P2",
            "requests_per_minute": 50,
            "tokens_per_minute": 5_000,
            "max_concurrent_requests": 2,
            "quota_period": "weekly",
            "quota_tokens": 200_000,
            "quota_amount": "20.0000",
            "currency": "EUR",
            "alert_thresholds": [75, 100],
            "model_access": "listed",
            "allowed_models": [w.public_model.served_name],
            "fair_share_weight": 3,
        },
    ),
    Resource(
        "apikey",
        lambda w: {
            "tenant": w.tenant_a.slug,
            "name": "audited-key",
            "expires_at": later(30),
            "requests_per_minute": 10,
            "tokens_per_minute": 1_000,
            "max_concurrent_requests": 1,
            "budget_tokens": 50_000,
            "budget_amount": "5.0000",
            "allowed_models": [w.public_model.served_name],
        },
        lambda w: {
            "name": "audited-key-2",
            "expires_at": later(60),
            "requests_per_minute": 20,
            "tokens_per_minute": 2_000,
            "max_concurrent_requests": 2,
            "budget_tokens": 60_000,
            "budget_amount": "6.0000",
            "allowed_models": [w.private_model_a.served_name],
        },
        once=frozenset({"tenant"}),
    ),
    Resource(
        "membership",
        lambda w: {"tenant": w.tenant_a.slug, "user": w.dave.username, "role": "member"},
        lambda w: {"role": "admin"},
        once=frozenset({"tenant", "user"}),
    ),
    Resource(
        "user",
        lambda w: {
            "username": "erin",
            "email": "erin@example.test",
            "first_name": "Erin",
            "last_name": "Example",
            "is_staff": False,
            "is_active": True,
            "password": "a long enough passphrase 91",
        },
        lambda w: {
            "username": "erin-2",
            "email": "erin.2@example.test",
            "first_name": "Erina",
            "last_name": "Sample",
            "is_staff": True,
            "password": "another long passphrase 92",
            "is_active": False,
        },
    ),
    Resource("admintoken", lambda w: {"name": "audited-token", "expires_at": later(30)}),
    Resource(
        "catalogmodel",
        lambda w: {
            "served_name": "audit-1b",
            "source": "org/audit-1b",
            "revision": "main",
            "task": "generate",
            "params_billions": "1.00",
            "active_params_billions": "0.50",
            "quantization": "bf16",
            "context_length": 4096,
            "visibility": "public",
            "trust_remote_code": False,
            "kv_bytes_per_token": 1024,
            "allowed_request_fields": [],
            "description": "For the audit.",
        },
        lambda w: {
            "served_name": "audit-1b-v2",
            "source": "org/audit-1b-v2",
            "revision": "v2",
            "task": "embed",
            "params_billions": "2.00",
            "active_params_billions": "1.00",
            "quantization": "fp8",
            "context_length": 8192,
            "visibility": "private",
            "trust_remote_code": True,
            "kv_bytes_per_token": 2048,
            "allowed_request_fields": ["chat_template_kwargs.documents_mode"],
            "description": "Changed.",
        },
    ),
    Resource(
        "adapter",
        # The platform's own first, then tenant A's: a tenant's adapter is named in its space.
        lambda w: {
            "served_name": "audit/lora",
            "base": w.public_model.served_name,
            "tenant": None,
            "visibility": "private",
            "source": "org/audit-lora",
            "pinned": False,
            "description": "For the audit.",
        },
        lambda w: {
            "served_name": f"{w.tenant_a.slug}/lora-2",
            "base": "audit-small",
            "tenant": w.tenant_a.slug,
            "visibility": "public",
            "source": "/root/.cache/huggingface/adapters/audit-lora-2",
            "pinned": True,
            "description": "Changed.",
        },
    ),
    Resource(
        "price",
        lambda w: {
            "model": w.public_model.served_name,
            "adapter": None,  # the model's own price (an adapter's: tests/metering)
            "currency": "USD",
            "input_per_mtok": "0.100000",
            "cached_input_per_mtok": "0.050000",
            "output_per_mtok": "0.300000",
            "effective_from": later(7),
        },
    ),
    Resource(
        "node",
        lambda w: {
            "name": "audit-node",
            "docker_url": "tcp://audit-proxy:2375",
            "queue": "node.audit",
            "engine_host": "10.0.0.9",
            "arch": "arm64",
            "gpu_description": "NVIDIA GB10",
            "gpu_count": 1,
            "total_memory_bytes": 128 * GIB,
            "gpu_memory_bytes": 0,
            "unified_memory": True,
            "memory_limit_bytes": 0,
            "high_speed_interface": "enp1s0f0np0",
            "high_speed_address": "192.168.100.9",
            "status": "online",
        },
        lambda w: {
            "name": "audit-node-2",
            "docker_url": "tcp://audit-proxy-2:2375",
            "queue": "node.audit-2",
            "engine_host": "10.0.0.10",
            "arch": "amd64",
            "gpu_description": "NVIDIA L40S",
            "gpu_count": 2,
            "total_memory_bytes": 64 * GIB,
            "gpu_memory_bytes": 48 * GIB,
            "unified_memory": False,
            "memory_limit_bytes": 32 * GIB,
            "high_speed_interface": "eth1",
            "high_speed_address": "192.168.100.10",
            "status": "disabled",
        },
    ),
    Resource(
        "deployment",
        # Tensor parallelism over two nodes, so that the worker's node is a field in use.
        lambda w: {
            "name": "audited",
            "model": w.public_model.served_name,
            "node": "spark-1",
            "worker_node": "spark-2",
            "profile": "simulator",
            "image": "tollgate/engine-sim:latest",
            "engine_args": {"tensor-parallel-size": 2},
            "env": {},
            "external": False,
            "external_url": "",
            "upstream_key": "",
            "replicas": 1,
            "cpus": 2,
            "mode": "always",
            "idle_timeout_seconds": 900,
            "start_timeout_seconds": 600,
        },
        lambda w: {
            "name": "audited-2",
            "model": "audit-small",
            "node": "spark-3",
            "worker_node": "spark-1",
            "profile": "dgx-spark",
            "image": "tollgate/engine-sim:v2",
            "engine_args": {"tensor-parallel-size": 2, "max-num-seqs": 2},
            "env": {"NCCL_DEBUG": "INFO"},
            "external_url": "http://10.0.0.20:8000",
            "upstream_key": "sk-audit-not-for-the-log",
            "replicas": 2,
            "cpus": 1.5,
            "idle_timeout_seconds": 1800,
            "start_timeout_seconds": 300,
        },
        # Replicas spanning two nodes cannot run on demand: a change of mode is audited in
        # tests/api/test_on_demand.py.
        once=frozenset({"external", "mode"}),
    ),
    Resource(
        "engineprofile",
        lambda w: {
            "name": "audit-profile",
            "description": "For the audit.",
            "image": "tollgate/engine-sim:latest",
            "engine_args": {"max-num-seqs": 4},
            "env": {},
            "cpu_headroom": 0.5,
        },
        lambda w: {
            "name": "audit-profile-2",
            "description": "Changed.",
            "image": "tollgate/engine-sim:v2",
            "engine_args": {"max-num-seqs": 2},
            "env": {"NCCL_DEBUG": "INFO"},
            "cpu_headroom": 1,
        },
    ),
    Resource("allowedimage", lambda w: {"pattern": "ghcr.io/audit/*", "note": "For the audit."}),
    Resource(
        "webhookendpoint",
        lambda w: {
            "tenant": None,  # a platform endpoint: it may change the events it receives
            "url": "https://hooks.acme.test/audited",
            "description": "Audited hook",
            "events": ["budget.threshold"],
            "enabled": True,
        },
        lambda w: {
            "url": "http://alerts.internal:8080/audited",
            "description": "Audited hook, moved",
            "events": ["engine.drift"],
            "enabled": False,
        },
        once=frozenset({"tenant"}),
    ),
]


def test_every_resource_with_writable_fields_is_covered() -> None:
    with_writes = {basename for basename in VIEWSETS if writable(basename)}
    assert {r.basename for r in RESOURCES} == with_writes


def test_the_console_forms_write_only_what_the_audit_log_records() -> None:
    """The console's model forms take their fields from the same lists (or some of them)."""
    audited = {Tenant: TENANT_FIELDS, CatalogModel: MODEL_FIELDS, Node: NODE_FIELDS}
    forms = [f for f in vars(console_forms).values() if _is_model_form(f)]
    assert len(forms) >= 3  # the module was read, not an empty list compared to nothing
    for form in forms:
        assert form._meta.model in audited, f"{form.__name__}: which list does it write?"
        assert set(form._meta.fields) <= set(audited[form._meta.model]), form.__name__


def _is_model_form(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, ModelForm) and value is not ModelForm


@pytest.fixture
def deployable(world: World) -> None:
    """What the deployment's samples name: two more nodes, the built-in profiles (two of
    them start a Ray group) and a second model."""
    ensure_builtin_profiles()
    for name in ("spark-2", "spark-3"):
        deployment_services.register_node(
            None,
            name=name,
            docker_url=f"tcp://{name}:2375",
            total_memory_bytes=128 * GIB,
            unified_memory=True,
            gpu_count=1,
        )
    deployment_services.create_model(
        None,
        served_name="audit-small",
        source="org/audit-small",
        params_billions=Decimal("0.5"),
        context_length=4096,
    )


def _detail(basename: str, body: dict[str, Any]) -> str:
    lookup = VIEWSETS[basename].lookup_field
    return reverse(f"{basename}-detail", args=[body["id" if lookup == "pk" else lookup]])


def _created(object_type: str, body: dict[str, Any]) -> AuditLog:
    return AuditLog.objects.get(action="create", object_type=object_type, object_id=body["id"])


def _holds_no_secret(entry: AuditLog, payload: dict[str, Any]) -> None:
    recorded = json.dumps(entry.changes)
    for name in SECRETS & payload.keys():
        if payload[name]:
            assert payload[name] not in recorded, f"{name}'s value is in the audit log"


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.basename)
def test_every_writable_field_reaches_the_audit_log(
    resource: Resource,
    world: World,
    deployable: None,
    client_for: Callable[..., APIClient],
) -> None:
    root = client_for(world.root)
    fields = writable(resource.basename)
    payload = resource.create(world)
    assert set(payload) == fields, "give every writable field a sample value"
    created = root.post(reverse(f"{resource.basename}-list"), payload, format="json")
    assert created.status_code == 201, created.content[:500]
    object_type = VIEWSETS[resource.basename].serializer_class.Meta.model._meta.model_name
    entry = _created(object_type, created.json())
    _holds_no_secret(entry, payload)
    missing = {"create": sorted(fields - entry.changes.keys()), "update": []}
    if updatable(resource.basename):
        missing["update"] = _unaudited_changes(resource, world, root, created.json())
    assert missing == {"create": [], "update": []}, "written through the API, not audited"


def _unaudited_changes(
    resource: Resource, world: World, root: APIClient, body: dict[str, Any]
) -> list[str]:
    """The fields whose change, one after the other, leaves no trace in an update entry."""
    if resource.basename == "deployment":
        # Stopped, so that each change is recorded without replacing engines.
        stop = root.post(_detail("deployment", body) + "stop/", format="json")
        assert stop.status_code == 200, stop.content[:500]
    changes = resource.changes(world)
    assert set(changes) == writable(resource.basename) - resource.once, (
        "give every changeable field a new value"
    )
    unaudited = []
    for name, value in changes.items():
        last = AuditLog.objects.latest("id").pk
        answer = root.patch(_detail(resource.basename, body), {name: value}, format="json")
        assert answer.status_code == 200, (name, answer.content[:500])
        body = answer.json()
        entry = AuditLog.objects.filter(pk__gt=last, action="update").first()
        if entry is None or name not in entry.changes:
            unaudited.append(name)
        else:
            _holds_no_secret(entry, {name: value})
    return unaudited
