"""Priority classes through the real gateway: a model whose engines take one request at a
time serves waiting requests P0 first, then P1, then P2, and gives up with Retry-After."""

import asyncio
import time

import httpx
import pytest

from tenants import services as tenant_services
from tests.gateway.conftest import World, add_routed_model, start_engine, stop, wait_until_served

pytestmark = pytest.mark.django_db(transaction=True)


async def ask(
    world: World, key: str, max_tokens: int, priority: str | None = None
) -> tuple[float, httpx.Response]:
    headers = {"Authorization": f"Bearer {key}"}
    if priority:
        headers["X-Tollgate-Priority"] = priority
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(
            f"{world.v1}/chat/completions",
            headers=headers,
            json={
                "model": "sim-queue",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens,
            },
        )
    return time.monotonic(), response


@pytest.fixture
def one_slot_model(world: World) -> World:
    engine, proc = start_engine(
        ("sim-queue",),
        "--sim-decode-tps",
        "50",
        "--sim-ttft-ms",
        "1",
        "--sim-output-tokens-min",
        "400",
        "--sim-output-tokens-max",
        "400",
    )
    add_routed_model(world, "sim-queue", engine.port, max_num_seqs=1)
    yield world
    stop(proc)


def test_waiting_requests_are_served_p0_then_p1_then_p2(one_slot_model: World) -> None:
    world = one_slot_model
    tenant_services.grant_interactive(None, world.tenant_b, 30)  # tenant B is P0 for now
    wait_until_served(world.url, world.key_b, "sim-queue")

    async def scenario() -> dict[str, float]:
        holder = asyncio.create_task(ask(world, world.key_a, 40))  # ~0.8 s in the only slot
        await asyncio.sleep(0.2)
        batch = asyncio.create_task(ask(world, world.key_a, 5, "P2"))
        await asyncio.sleep(0.1)
        standard = asyncio.create_task(ask(world, world.key_a, 5))
        await asyncio.sleep(0.1)
        interactive = asyncio.create_task(ask(world, world.key_b, 5))
        done = {
            name: await task
            for name, task in [
                ("holder", holder),
                ("batch", batch),
                ("standard", standard),
                ("interactive", interactive),
            ]
        }
        assert all(r.status_code == 200 for _, r in done.values()), {
            k: r.text for k, (_, r) in done.items()
        }
        assert done["batch"][1].headers["x-tollgate-priority"] == "P2"
        assert done["interactive"][1].headers["x-tollgate-priority"] == "P0"
        return {name: at for name, (at, _) in done.items()}

    finished = asyncio.run(scenario())
    assert finished["holder"] < finished["interactive"] < finished["standard"] < finished["batch"]


def test_a_request_that_waits_too_long_gets_429_with_retry_after(one_slot_model: World) -> None:
    world = one_slot_model

    async def scenario() -> tuple[httpx.Response, float]:
        holder = asyncio.create_task(ask(world, world.key_a, 300))  # ~6 s in the only slot
        await asyncio.sleep(0.3)
        started = time.monotonic()
        at, refused = await ask(world, world.key_b, 5)  # P1 waits at most 4 s
        await holder
        return refused, at - started

    refused, waited = asyncio.run(scenario())
    assert refused.status_code == 429 and 3.5 < waited < 6
    assert int(refused.headers["retry-after"]) >= 1
    assert (
        refused.json()["error"]["code"] == "rate_limit_exceeded"
        and "waited" in refused.json()["error"]["message"]
    )
