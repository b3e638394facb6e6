"""The controller judges whether the gateway's preemption frees an engine slot, and the
gateway preempts only where it does.

The engines (the simulator, 25 tokens/s) pause every streamed sequence after its 20th
token until SIGUSR1 (``--sim-pause-after-tokens 20``), so the P2 stream and, on an engine
that finishes abandoned requests (``--sim-finish-abandoned``), the victim the gateway
aborted stay on the engine as long as the test needs them, however slow the machine.
The controller's tick (``gateway.tune_admission``, every 5 s under beat) and the engines'
scrape are called here directly.
"""

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from django.db import connections

from core.keyspace import preempt_verdict_key
from core.redis import get_redis
from deployments.fleet import scrape_all
from deployments.models import CatalogModel
from gateway.admission import pool_status
from gateway.tuning import tune_all
from tenants import services as tenant_services
from tests.engine_sim.conftest import wait_until
from tests.gateway.conftest import (
    METRICS_TOKEN,
    World,
    add_routed_model,
    start_engine,
    start_gateway,
    stop,
    wait_until_served,
)
from tests.gateway.test_preempt_e2e import MESSAGES, REPLY, Stream, stream, until_tokens

pytestmark = pytest.mark.django_db(transaction=True)


def metric(url: str, name: str, model: str) -> float | None:
    page = httpx.get(
        f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    ).text
    values = [
        float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith(name + "{") and f'model="{model}"' in line
    ]
    return sum(values) if values else None


def verdict_after_ticks(model: CatalogModel, timeout: float = 30.0) -> bytes:
    """Scrape the engines and run the controller until it stores a verdict on the model."""

    def tick() -> bytes | None:
        scrape_all()
        tune_all()
        return get_redis().get(preempt_verdict_key(model.pk))

    try:
        return wait_until(tick, timeout, "the controller's verdict")
    finally:
        connections.close_all()  # this runs in a thread of its own (asyncio.to_thread)


class Setup:
    def __init__(self, world: World, finish_abandoned: bool) -> None:
        self.name = "sim-keeps" if finish_abandoned else "sim-drops"
        args = ["--sim-decode-tps", "25", "--sim-ttft-ms", "20", "--sim-pause-after-tokens", "20"]
        args += ["--sim-output-tokens-min", "400", "--sim-output-tokens-max", "400"]
        if finish_abandoned:
            args.append("--sim-finish-abandoned")
        self.engine, self.engine_proc = start_engine((self.name,), *args)
        self.model = add_routed_model(world, self.name, self.engine.port, max_num_seqs=1)
        tenant_services.grant_interactive(None, world.tenant_b, 30)  # tenant B is P0
        # One worker: what its /metrics says is what the process admitting requests knows.
        self.gateway, self.url = start_gateway(1, {"TOLLGATE_QUEUE_TIMEOUT_P0": "60"})
        wait_until_served(self.url, world.key_b, self.name, timeout=30)
        wait_until_served(self.url, world.key_a, self.name, timeout=30)

    def release_engine(self) -> None:
        os.kill(self.engine_proc.pid, signal.SIGUSR1)

    def close(self) -> None:
        stop(self.gateway)
        stop(self.engine_proc)

    def preemptions(self) -> float:
        return metric(self.url, "tollgate_preemptions_total", self.name) or 0.0

    def effective(self) -> float | None:
        return metric(self.url, "tollgate_admission_preemption_effective", self.name)


@pytest.fixture(params=[True, False], ids=["finishes-abandoned", "drops-abandoned"])
def setup(request: pytest.FixtureRequest, world: World) -> Iterator[Setup]:
    s = Setup(world, request.param)
    yield s
    s.close()


async def p0(url: str, key: str, model: str) -> tuple[int, float]:
    async with httpx.AsyncClient(timeout=90) as client:
        r = await client.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
    assert r.headers.get("x-tollgate-priority") == "P0", r.text
    return r.status_code, time.monotonic()


def test_preemption_goes_on_only_where_it_frees_a_slot(world: World, setup: Setup) -> None:
    keeps = setup.name == "sim-keeps"
    body = {"model": setup.name, "messages": MESSAGES, "max_tokens": REPLY, "stream": True}
    body["stream_options"] = {"include_usage": True}

    async def scenario() -> tuple[Stream, bytes, float]:
        p2 = Stream()
        task = asyncio.create_task(stream(setup.url, world.key_a, "chat/completions", body, p2))
        await until_tokens(p2, 10)
        status, _ = await p0(setup.url, world.key_b, setup.name)
        assert status == 200
        assert setup.preemptions() == 1  # P0 took the P2 stream's slot
        # The P2 stream resumed and paused at its engine request's 20th token; where the
        # engine finishes abandoned requests, the aborted one still runs (paused) beside it.
        verdict = await asyncio.to_thread(verdict_after_ticks, setup.model)
        want = 0 if keeps else 1
        await asyncio.to_thread(
            wait_until, lambda: setup.effective() == want, 30, "the gateway to read the verdict"
        )
        second = asyncio.create_task(p0(setup.url, world.key_b, setup.name))
        if keeps:
            # No preemption: P0 waits for the slot the paused P2 stream holds.
            await asyncio.to_thread(
                wait_until,
                lambda: pool_status(setup.model.pk, 1).waiting["P0"] == 1,
                30,
                "the second P0 request to queue",
            )
            assert setup.preemptions() == 1 and not task.done()
            setup.release_engine()
            status, p0_done = await second
        else:
            status, p0_done = await second  # it preempted the paused P2 stream again
            assert not task.done()
            setup.release_engine()
        assert status == 200
        await task
        return p2, verdict, p0_done

    p2, verdict, p0_done = asyncio.run(scenario())
    assert verdict == (b"0" if keeps else b"1")
    assert setup.preemptions() == (1 if keeps else 2)
    # Either way the P2 client got one whole stream.
    assert p2.status == 200 and p2.done_frames == 1 and p2.content_tokens() == REPLY
    if keeps:
        assert p0_done > p2.finished_at - 0.5  # the second P0 request waited for the P2 stream
