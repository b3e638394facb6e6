"""Tenants' LoRA adapters on the real vLLM, through Tollgate (issue 29).

One deployment of the tiny test model with adapters enabled and one adapter slot
(``enable-lora``, ``max-loras 1``, ``max-lora-rank 8``), run by the node's worker as on an
appliance. Tenant A registers the two test adapters (``scripts/make-test-model`` stages them
beside the model); the worker checks their files; through the gateway with the ``openai``
SDK the base and each adapter answer differently at temperature 0, each time the same
although the single slot makes every switch unload one and load the other; tenant B cannot
tell them from missing models on any API; after ``docker kill`` the restarted engine serves
them again with nobody's help; each adapter's usage is billed at its own price.
"""

from __future__ import annotations

import csv
import io
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

import anthropic
import docker
import httpx
import openai
import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone

from deployments import adapter_loading, runtime, services
from deployments.adapters import create_adapter
from deployments.choices import AdapterStatus
from deployments.models import Adapter, CatalogModel, Deployment, EngineProfile, Node, Replica
from deployments.profiles import ensure_builtin_profiles
from metering import rollups
from metering import services as metering_services
from metering.models import UsageEvent
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.gateway.conftest import start_gateway, stop, wait_until_served
from tests.scaleout.conftest import stop_worker
from tests.vllm.conftest import CONTEXT, SERVED_NAME, TEST_MODEL, mark_staged
from tests.vllm.stack import GATEWAY_LOG, batch_queue, drive, ingest_until, start_worker

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]
NAME = "tiny-lora"
START = 600.0  # seconds: a cold start is ~1 min on two cores, several on a loaded machine
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


@dataclass
class LoraAppliance:
    url: str
    node: Node
    deployment: Deployment
    worker: subprocess.Popen
    key_a: str
    key_b: str
    admin_token: str
    stack: str

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)


@pytest.fixture
def lora_appliance(
    vllm_stack: str,
    docker_node: Node,
    tiny_llama: object,
    tenant_a: Tenant,
    tenant_b: Tenant,
    redis_namespace: str,
    root: AbstractBaseUser,
    settings: object,
) -> Iterator[LoraAppliance]:
    settings.TOLLGATE_ENGINE_POLL_SECONDS = 0.5
    extra = {
        "TOLLGATE_REDIS_PREFIX": redis_namespace,
        "TOLLGATE_BATCH_QUEUE": batch_queue(vllm_stack),
        # Adapter loads to the node's worker below (on an appliance: the control worker).
        "TOLLGATE_DEMAND_QUEUE": docker_node.queue,
    }
    gateway, url = start_gateway(2, extra, log=GATEWAY_LOG)
    worker = start_worker(docker_node, vllm_stack, url)
    try:
        metering_services.set_price(None, tiny_llama, Decimal("1"), Decimal("0.5"), Decimal("2"))
        key_a = tenant_services.issue_api_key(None, tenant_a, name="a").plaintext
        key_b = tenant_services.issue_api_key(None, tenant_b, name="b").plaintext
        token = tenant_services.issue_admin_token(root, name="finance").plaintext
        drive(lambda: Node.objects.get(pk=docker_node.pk).last_seen_at, 60)
        ensure_builtin_profiles()
        mark_staged(tiny_llama, docker_node)
        deployment = services.create_deployment(
            None,
            name=NAME,
            model=tiny_llama,
            node=docker_node,
            profile=EngineProfile.objects.get(name="cpu"),
            engine_args={
                "max-model-len": CONTEXT,
                "enable-lora": True,
                "max-loras": 1,
                "max-lora-rank": 8,
            },
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        )
        yield LoraAppliance(url, docker_node, deployment, worker, key_a, key_b, token, vllm_stack)
    finally:
        stop_worker(worker)
        stop(gateway)


def ready_replica() -> Replica | None:
    return Replica.objects.filter(deployment__name=NAME, state="ready", healthy=True).first()


def greedy(client: openai.OpenAI, model: str) -> tuple[str, int, int]:
    """(text, prompt tokens, completion tokens) of a short answer at temperature 0."""
    answer = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=12, temperature=0
    )
    usage = answer.usage
    return answer.choices[0].message.content, usage.prompt_tokens, usage.completion_tokens


def engine_adapters(replica: Replica) -> set[str]:
    """The adapters the engine itself lists (cards whose parent is the base)."""
    cards = httpx.get(f"{replica.base_url}/v1/models", timeout=10).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def register(tenant: Tenant, name: str, letter: str) -> Adapter:
    return create_adapter(
        None,
        served_name=name,
        base=CatalogModel.objects.get(served_name=SERVED_NAME),
        tenant=tenant,
        source=f"{TEST_MODEL}-lora-{letter}",
    )


def checked(adapter: Adapter) -> Adapter:
    def ready() -> Adapter | None:
        """the worker to check the adapter's files"""
        row = Adapter.objects.get(pk=adapter.pk)
        assert row.status != AdapterStatus.FAILED, row.status_message
        return row if row.status == AdapterStatus.READY else None

    return drive(ready, 180, every=1.0)


def refused_like_missing(app: LoraAppliance, name: str) -> None:
    """Tenant B's every API answers ``name`` exactly as a model that does not exist."""
    headers = {"Authorization": f"Bearer {app.key_b}"}
    listed = httpx.get(f"{app.url}/v1/models", headers=headers, timeout=10).json()["data"]
    assert name not in {c["id"] for c in listed}
    calls = {
        "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
        "/v1/completions": {"prompt": "The sea", "max_tokens": 2},
        "/v1/responses": {"input": "The sea", "max_output_tokens": 2},
        "/v1/messages": {"messages": CHAT, "max_tokens": 2},
    }
    for path, body in calls.items():
        answers = []
        for model in (name, "no-such/model"):
            r = httpx.post(
                app.url + path, json={"model": model, **body}, headers=headers, timeout=30
            )
            answers.append((r.status_code, r.text.replace(model, "<model>")))
        assert answers[0] == answers[1], (path, answers)
        assert answers[0][0] == 404, (path, answers)
    r = httpx.get(f"{app.url}/v1/models/{name}", headers=headers, timeout=10)
    missing = httpx.get(f"{app.url}/v1/models/no-such", headers=headers, timeout=10)
    assert r.status_code == missing.status_code == 404
    assert r.text.replace(name, "x") == missing.text.replace("no-such", "x")
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=app.url, api_key=app.key_b, max_retries=0).messages.create(
            model=name, messages=CHAT, max_tokens=2
        )


def test_tenant_adapters_loaded_routed_isolated_restored_and_billed(
    lora_appliance: LoraAppliance, tenant_a: Tenant
) -> None:
    app = lora_appliance
    replica = drive(ready_replica, START, every=1.0)
    sea_a = checked(register(tenant_a, "acme/sea-a", "a"))
    sea_b = checked(register(tenant_a, "acme/sea-b", "b"))
    assert (sea_a.rank, sorted(sea_a.target_modules)) == (8, ["q_proj", "v_proj"])
    metering_services.set_price(
        None, sea_a.base, Decimal("3"), Decimal("1"), Decimal("5"), adapter=sea_a
    )
    wait_until_served(app.url, app.key_a, "acme/sea-b", timeout=30)
    listed = {m.id: m for m in app.openai(app.key_a).models.list()}
    assert listed["acme/sea-a"].model_extra["parent"] == SERVED_NAME

    client = app.openai(app.key_a)
    seen = {"base": [], "a": [], "b": []}
    names = {"base": SERVED_NAME, "a": "acme/sea-a", "b": "acme/sea-b"}
    for turn in ("base", "a", "b", "a", "b", "base", "a"):
        seen[turn].append(greedy(client, names[turn]))
        # One slot: the engine never holds more than one adapter.
        assert len(engine_adapters(replica)) <= 1
        assert len(adapter_loading.loaded(replica.pk)) <= 1
    first = {turn: answers[0][0] for turn, answers in seen.items()}
    assert len(set(first.values())) == 3, first  # three different answers
    for turn, answers in seen.items():
        assert {text for text, _, _ in answers} == {first[turn]}, (turn, answers)

    refused_like_missing(app, "acme/sea-a")
    refused_like_missing(app, "acme/sea-b")

    # The engine dies; reconcile restarts it and the worker gives it back its adapter.
    (container,) = docker.from_env().containers.list(
        filters={"label": f"{runtime.LABEL_STACK}={app.stack}"}
    )
    container.kill()

    def restarted() -> Replica | None:
        """the killed replica to be restarted and ready"""
        again = ready_replica()
        return again if again and again.restart_count == 1 else None

    again = drive(restarted, START, every=2.0)
    wait_until_served(app.url, app.key_a, SERVED_NAME, timeout=30)
    assert engine_adapters(again) == {"acme/sea-a"}  # what it held: restored before ready
    for turn in ("a", "b"):
        seen[turn].append(greedy(client, names[turn]))
        assert seen[turn][-1][0] == first[turn]

    # Billing: each adapter's events, at its own price (the base's for b), equal what the
    # clients were told.
    total = sum(len(answers) for answers in seen.values())
    ingest_until(total)
    for turn, adapter in (("a", sea_a), ("b", sea_b)):
        events = UsageEvent.objects.filter(adapter=adapter)
        told = seen[turn]
        assert events.count() == len(told)
        assert sum(e.prompt_tokens for e in events) == sum(p for _, p, _ in told)
        assert sum(e.completion_tokens for e in events) == sum(c for _, _, c in told)
    a_event = UsageEvent.objects.filter(adapter=sea_a).first()
    b_event = UsageEvent.objects.filter(adapter=sea_b).first()
    assert a_event.price.adapter_id == sea_a.pk
    assert b_event.price.adapter_id is None and b_event.price.model_id == sea_b.base_id
    base_events = UsageEvent.objects.filter(adapter__isnull=True, model=sea_a.base)
    assert base_events.count() == len(seen["base"])
    check_showback(
        app,
        seen,
        {"a": Decimal("3"), "b": Decimal("1")},
        {"a": Decimal("1"), "b": Decimal("0.5")},
        {"a": Decimal("5"), "b": Decimal("2")},
    )


PRICE_KINDS = ("input", "cached_input", "output")


def check_showback(
    app: LoraAppliance, seen: dict, input_price: dict, cached_price: dict, output_price: dict
) -> None:
    """The finance lead's CSV: one line per adapter with the tokens its clients were told, at
    its price (per 1M tokens; b has none of its own: the base's)."""
    now = timezone.now()
    rollups.rebuild_rollups(now - timedelta(days=1), now + timedelta(hours=1))
    answer = httpx.get(
        f"{app.url}/api/v1/usage/export.csv",
        params={"tenant": "acme", "granularity": "month", "period": f"{now:%Y-%m}"},
        headers={"Authorization": f"Bearer {app.admin_token}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    lines = {r["adapter"]: r for r in csv.DictReader(io.StringIO(answer.text))}
    for turn, name in (("a", "acme/sea-a"), ("b", "acme/sea-b")):
        line, told = lines[name], seen[turn]
        prompt, completion = sum(p for _, p, _ in told), sum(c for _, _, c in told)
        assert (int(line["prompt_tokens"]), int(line["completion_tokens"])) == (prompt, completion)
        cached = int(line["cached_tokens"])
        rates = (input_price[turn], cached_price[turn], output_price[turn])
        assert tuple(Decimal(line[f"{k}_per_mtok"]) for k in PRICE_KINDS) == rates
        per_mtok = (prompt - cached) * rates[0] + cached * rates[1] + completion * rates[2]
        # Each request's cost is rounded up to a billionth: at most that much apart each.
        gap = Decimal(line["cost"]) - per_mtok / 10**6
        assert 0 <= gap <= Decimal(len(told)) / 10**9, (name, line, per_mtok)
    assert int(lines[""]["requests"]) == len(seen["base"])  # the base model's own line
