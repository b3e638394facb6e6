"""Priority classes through the real gateway: a model whose engines take one request at a
time serves waiting requests P0 first, then P1, then P2, and gives up with Retry-After."""

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from tenants import services as tenant_services
from tests.gateway.conftest import (
    METRICS_TOKEN,
    Engine,
    World,
    add_routed_model,
    start_engine,
    stop,
    wait_until_served,
)

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


@dataclass
class OneSlot:
    """A model whose engine takes one request at a time and generates nothing until
    released (--sim-hold, SIGUSR1): what waits, waits however slow the machine is."""

    world: World
    engine: Engine
    proc: subprocess.Popen

    def release(self) -> None:
        os.kill(self.proc.pid, signal.SIGUSR1)

    async def engine_running(self) -> float:
        async with httpx.AsyncClient(timeout=30) as client:
            page = (await client.get(f"{self.engine.url}/metrics")).text
        return sum(
            float(line.split()[-1])
            for line in page.splitlines()
            if line.startswith("vllm:num_requests_running{")
        )

    async def engine_running_is(self, n: int) -> bool:
        return await self.engine_running() == n

    async def queued_is(self, n: int) -> bool:
        return await self.queued() == n

    async def queued(self) -> float:
        """Requests waiting at the gateway for the slot, summed over its workers."""
        async with httpx.AsyncClient(timeout=30) as client:
            page = (
                await client.get(
                    f"{self.world.url}/metrics",
                    headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
                )
            ).text
        return sum(
            float(line.split()[-1])
            for line in page.splitlines()
            if line.startswith("tollgate_queue_depth{")
        )


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
def one_slot_model(world: World) -> Iterator[OneSlot]:
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
        "--sim-hold",
    )
    add_routed_model(world, "sim-queue", engine.port, max_num_seqs=1)
    yield OneSlot(world, engine, proc)
    stop(proc)


def test_waiting_requests_are_served_p0_then_p1_then_p2(one_slot_model: OneSlot) -> None:
    slot = one_slot_model
    world = slot.world
    tenant_services.grant_interactive(None, world.tenant_b, 30)  # tenant B is P0 for now
    wait_until_served(world.url, world.key_b, "sim-queue")

    async def scenario() -> dict[str, float]:
        # The holder takes the only slot; the others arrive worst class first and wait at the
        # gateway; only then does the engine start generating.
        # The holder is P0 too: a P0 arriving behind it cannot preempt it.
        holder = asyncio.create_task(ask(world, world.key_b, 40))
        await until(lambda: slot.engine_running_is(1), "the holder in the slot")
        batch = asyncio.create_task(ask(world, world.key_a, 5, "P2"))
        await until(lambda: slot.queued_is(1), "P2 to queue")
        standard = asyncio.create_task(ask(world, world.key_a, 5))
        await until(lambda: slot.queued_is(2), "P1 to queue")
        interactive = asyncio.create_task(ask(world, world.key_b, 5))
        await until(lambda: slot.queued_is(3), "P0 to queue")
        slot.release()
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


def test_a_request_that_waits_too_long_gets_429_with_retry_after(one_slot_model: OneSlot) -> None:
    slot = one_slot_model
    world = slot.world

    async def scenario() -> tuple[httpx.Response, float]:
        holder = asyncio.create_task(ask(world, world.key_a, 300))  # held in the only slot
        await until(lambda: slot.engine_running_is(1), "the holder in the slot")
        started = time.monotonic()
        at, refused = await ask(world, world.key_b, 5)  # P1 waits at most 4 s
        slot.release()
        await holder
        return refused, at - started

    refused, waited = asyncio.run(scenario())
    assert refused.status_code == 429 and 3.5 < waited < 6
    assert int(refused.headers["retry-after"]) >= 1
    assert (
        refused.json()["error"]["code"] == "rate_limit_exceeded"
        and "waited" in refused.json()["error"]["message"]
    )
