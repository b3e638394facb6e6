"""Tenants' LoRA adapters through the gateway, on simulator engines with adapters enabled.

The worker's part (loading an adapter into an engine: deployments/adapter_loading.py) is
called by the test itself where a worker would run it, on the real simulator process; the
gateway is the real gunicorn server. tests/vllm/test_tenant_adapters.py runs the whole path,
worker included, on the real vLLM.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from django.conf import settings as django_settings
from django.db import transaction

from core.keyspace import lora_keys
from core.redis import get_redis
from deployments import adapter_loading
from deployments.adapters import create_adapter
from deployments.choices import AdapterStatus
from deployments.models import Adapter, CatalogModel, Replica
from metering import services as metering_services
from tests.engine_sim.conftest import start_sim  # noqa: F401
from tests.engine_sim.test_lora import hub_adapter
from tests.gateway.conftest import (  # noqa: F401
    METRICS_TOKEN,
    ROOT,
    World,
    add_routed_model,
    engines,
    gateway_url,
    redis_namespace,
    start_gateway,
    stop,
    wait_until_served,
    world,
)
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
BASE = "lora-base"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
# Seconds the gateway below waits for a worker to load an adapter: time enough on a loaded
# machine for the test, acting as the worker, to see the task and load it.
LOAD_TIMEOUT = 10
QUEUE = f"adapters-{secrets.token_hex(4)}"  # its adapter loads' queue: no worker's but ours


@pytest.fixture(scope="module")
def quick_gateway(gateway_url: str) -> Iterator[str]:  # noqa: F811
    """A gateway that waits only a few seconds for an adapter to be loaded."""
    env = {"TOLLGATE_ADAPTER_LOAD_TIMEOUT": str(LOAD_TIMEOUT), "TOLLGATE_DEMAND_QUEUE": QUEUE}
    # The broker queued_loads() reads: tests/batches/conftest.py, loaded whenever the whole
    # suite is collected, puts another Redis database in this process's environment.
    env["CELERY_BROKER_URL"] = django_settings.REDIS_URL
    proc, url = start_gateway(2, env, log=ROOT / ".pytest-gateway-adapters.log")
    yield url
    stop(proc)


@pytest.fixture
def lora(world: World, quick_gateway: str, start_sim, tmp_path: Path) -> World:  # noqa: F811
    """A base model served by a simulator with adapters enabled (two slots), and two of
    tenant A's adapters, checked, on it."""
    hf_home = tmp_path / "hf"
    for repo in ("acme/sea-lora", "acme/sky-lora"):
        hub_adapter(hf_home, repo)
    sim = start_sim(
        "some/base",
        "--served-model-name",
        BASE,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--sim-output-tokens-min",
        "8",
        "--sim-output-tokens-max",
        "8",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HOME": str(hf_home)},
    )
    world = replace(world, url=quick_gateway)
    base = add_routed_model(
        world, BASE, sim.port, max_num_seqs=4, engine_args={"enable-lora": True, "max-loras": 2}
    )
    # Checked as they are registered (one transaction): the gateway's reload that makes them
    # known reads them ready, never "still being checked".
    with transaction.atomic():
        for name, repo in (("acme/sea", "acme/sea-lora"), ("acme/sky", "acme/sky-lora")):
            adapter = create_adapter(
                None, served_name=name, base=base, tenant=world.tenant_a, source=repo
            )
            Adapter.objects.filter(pk=adapter.pk).update(status=AdapterStatus.READY, rank=8)
    metering_services.set_price(None, base, Decimal("1"), Decimal("0.5"), Decimal("2"))
    wait_until_served(world.url, world.key_a, "acme/sky")
    yield world
    r = get_redis()
    replica = Replica.objects.get(deployment__model=base)
    r.delete(*lora_keys(replica.pk), QUEUE, f"_kombu.binding.{QUEUE}")


def loads_asked(world: World, adapter: str) -> float:
    """The gateway's tollgate_adapter_loads_requested_total for ``adapter`` (both workers)."""
    page = httpx.get(
        f"{world.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    ).text
    return sum(
        float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith("tollgate_adapter_loads_requested_total{")
        and f'model="{adapter}"' in line
    )


def queued_loads() -> list[list[int]]:
    """The arguments of the load tasks waiting on the gateway's demand queue (Celery's Redis
    transport keeps a queue as a list of JSON messages)."""
    found = []
    for raw in get_redis().lrange(QUEUE, 0, -1):
        headers = json.loads(raw)["headers"]
        assert headers["task"] == "deployments.load_adapter"
        found.append(json.loads(headers["argsrepr"]))
    return found


def gateway_warnings() -> str:
    """What the gateway logged above INFO (why a load it asked for is not on the queue)."""
    log = ROOT / ".pytest-gateway-adapters.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "gateway log:\n" + "\n".join(line for line in lines[-60:] if "UserWarning" not in line)


def chat(world: World, model: str, key: str | None = None) -> httpx.Response:
    return httpx.post(
        f"{world.v1}/chat/completions",
        json={"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0},
        headers={"Authorization": f"Bearer {key or world.key_a}"},
        timeout=30,
    )


def as_worker(adapter_name: str) -> None:
    """What the worker does on the task the gateway queued: load it into the replica."""
    adapter = Adapter.objects.get(served_name=adapter_name)
    replica = Replica.objects.get(deployment__model=adapter.base)
    adapter_loading.load_by_ids(adapter.pk, replica.pk)


def test_owner_sees_adapters_with_their_base_and_others_see_nothing(lora: World) -> None:
    mine = httpx.get(
        f"{lora.v1}/models", headers={"Authorization": f"Bearer {lora.key_a}"}, timeout=10
    ).json()["data"]
    cards = {c["id"]: c for c in mine}
    assert cards["acme/sea"]["parent"] == BASE and "parent" not in cards[BASE]
    theirs = httpx.get(
        f"{lora.v1}/models", headers={"Authorization": f"Bearer {lora.key_b}"}, timeout=10
    ).json()["data"]
    assert BASE in {c["id"] for c in theirs}
    assert not {"acme/sea", "acme/sky"} & {c["id"] for c in theirs}
    for path, body in (
        ("chat/completions", {"messages": CHAT}),
        ("completions", {"prompt": "The sea"}),
        ("responses", {"input": "The sea"}),
        ("messages", {"messages": CHAT, "max_tokens": 4}),
    ):
        seen = []
        for model in ("acme/sea", "acme/missing"):
            r = httpx.post(
                f"{lora.v1}/{path}",
                json={"model": model, **body},
                headers={"Authorization": f"Bearer {lora.key_b}", "x-api-key": lora.key_b},
                timeout=10,
            )
            seen.append((r.status_code, r.text.replace(model, "<m>")))
        assert seen[0] == seen[1] and seen[0][0] == 404, (path, seen)


def test_a_request_waits_for_its_adapter_to_be_loaded_then_is_answered_by_it(
    lora: World,
) -> None:
    replica = Replica.objects.get(deployment__model__served_name=BASE)
    answers: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answers.append(chat(lora, "acme/sea")))
    waiting.start()
    # The gateway asked a worker for it (once): the task is on the demand queue.
    adapter_id = Adapter.objects.get(served_name="acme/sea").pk
    deadline = time.monotonic() + LOAD_TIMEOUT
    while not loads_asked(lora, "acme/sea"):
        assert time.monotonic() < deadline, "the gateway never asked for the adapter"
        time.sleep(0.05)
    as_worker("acme/sea")
    waiting.join(30)
    # However often the request looked again while it waited, it asked once.
    assert loads_asked(lora, "acme/sea") == 1
    assert queued_loads() == [[adapter_id, replica.pk]], gateway_warnings()
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    sea = answer.json()
    base = chat(lora, BASE).json()
    assert sea["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    assert sea["model"] == "acme/sea"
    # Billed as the adapter's usage on its base, at the base's price (it has none of its own).
    event = usage_event(answer.headers["x-request-id"])
    adapter = Adapter.objects.get(served_name="acme/sea")
    assert (event.adapter_id, event.model_id) == (adapter.pk, adapter.base_id)
    assert event.completion_tokens == sea["usage"]["completion_tokens"] == 8
    assert event.price_id is not None
    # Its use is recorded for the worker's least-recently-used unloading.
    deadline = time.monotonic() + 5
    while get_redis().zscore(lora_keys(replica.pk)[1], adapter.pk) is None:
        assert time.monotonic() < deadline, "the use was never recorded"
        time.sleep(0.1)


def test_an_adapter_with_its_own_price_is_billed_at_it(lora: World) -> None:
    sky = Adapter.objects.get(served_name="acme/sky")
    price = metering_services.set_price(
        None, sky.base, Decimal("7"), Decimal("1"), Decimal("9"), adapter=sky
    )
    as_worker("acme/sky")
    deadline = time.monotonic() + 10
    while True:
        answer = chat(lora, "acme/sky")
        assert answer.status_code == 200, answer.text
        event = usage_event(answer.headers["x-request-id"])
        if event.price_id == price.pk:
            break
        assert time.monotonic() < deadline, "the gateway never billed the adapter's own price"
        time.sleep(0.2)


def test_no_worker_loads_it_in_time_a_clear_503_and_a_failed_load_says_why(
    lora: World,
) -> None:
    started = time.monotonic()
    answer = chat(lora, "acme/sky")
    assert answer.status_code == 503
    assert time.monotonic() - started >= LOAD_TIMEOUT - 0.5
    error = answer.json()["error"]
    assert error["code"] == "model_not_ready" and "acme/sky" in error["message"]
    assert answer.headers["retry-after"]
    # The worker tried and the engine refused: waiting requests are told why at once.
    sky = Adapter.objects.get(served_name="acme/sky")
    Adapter.objects.filter(pk=sky.pk).update(source="acme/not-staged")
    as_worker("acme/sky")
    answer = chat(lora, "acme/sky")
    assert answer.status_code == 503
    assert "No adapter found" in answer.json()["error"]["message"], answer.text


def test_an_adapter_whose_check_just_ended_is_served_not_still_being_checked(
    lora: World,
) -> None:
    """The admin API says ready the moment the check ends; the gateway's processes hear of it
    a moment later (CI's compose stage: a request in between was told "still being
    checked"). A process that still knows the adapter as being checked looks again first."""
    base = CatalogModel.objects.get(served_name=BASE)
    create_adapter(
        None, served_name="acme/tide", base=base, tenant=lora.tenant_a, source="acme/sea-lora"
    )
    wait_until_served(lora.url, lora.key_a, "acme/tide")
    answer = chat(lora, "acme/tide")
    assert answer.status_code == 503 and "still being checked" in answer.text
    # The check ends and no gateway process is told yet (as if the news were on its way).
    Adapter.objects.filter(served_name="acme/tide").update(status=AdapterStatus.READY, rank=8)
    answers: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answers.append(chat(lora, "acme/tide")))
    waiting.start()
    deadline = time.monotonic() + LOAD_TIMEOUT
    while not loads_asked(lora, "acme/tide"):
        assert time.monotonic() < deadline, f"never asked for: {[a.text for a in answers]}"
        time.sleep(0.05)
    as_worker("acme/tide")
    waiting.join(30)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "acme/tide"


def test_an_adapter_not_yet_checked_or_failed_says_so_to_its_owner(lora: World) -> None:
    base = CatalogModel.objects.get(served_name=BASE)
    create_adapter(None, served_name="acme/new", base=base, tenant=lora.tenant_a, source="a/b")
    wait_until_served(lora.url, lora.key_a, "acme/new")
    answer = chat(lora, "acme/new")
    assert answer.status_code == 503 and "still being checked" in answer.text
    Adapter.objects.filter(served_name="acme/new").update(
        status=AdapterStatus.FAILED, status_message="Its rank 64 is above 8."
    )
    adapter = Adapter.objects.get(served_name="acme/new")
    from core.changes import publish_change

    publish_change("adapter", adapter.pk)
    deadline = time.monotonic() + 10
    while (answer := chat(lora, "acme/new")).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert answer.status_code == 400 and "rank 64" in answer.json()["error"]["message"]


def test_an_adapter_its_engine_dropped_meanwhile_is_loaded_again_not_a_404(lora: World) -> None:
    """A worker's unload can cross a request routed by a moment-old table (or an engine can
    lose its adapters behind Tollgate's back): the engine's 404 never reaches the client; the
    gateway has it loaded again and answers."""
    as_worker("acme/sea")
    deadline = time.monotonic() + 10
    while chat(lora, "acme/sea").status_code != 200:
        assert time.monotonic() < deadline, "the gateway never served the loaded adapter"
        time.sleep(0.1)
    replica = Replica.objects.get(deployment__model__served_name=BASE)
    gone = httpx.post(
        f"{replica.base_url}/v1/unload_lora_adapter", json={"lora_name": "acme/sea"}, timeout=10
    )
    assert gone.status_code == 200, gone.text
    answers: list[httpx.Response] = []
    asked = loads_asked(lora, "acme/sea")
    waiting = threading.Thread(target=lambda: answers.append(chat(lora, "acme/sea")))
    waiting.start()
    deadline = time.monotonic() + LOAD_TIMEOUT
    while loads_asked(lora, "acme/sea") == asked:
        assert time.monotonic() < deadline, "the gateway never asked for the adapter again"
        time.sleep(0.05)
    as_worker("acme/sea")
    waiting.join(30)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "acme/sea"
