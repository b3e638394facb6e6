"""Admission: the shared priority queue in Redis, fair share, P2 gating, the controller."""

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from core.keyspace import open_keys, pool_keys
from gateway.admission import Admission, Claim, Ticket, lowered, pool_status, wait_stats
from gateway.controller import ControllerState, Sample, next_ceiling


def run(coro: object) -> object:
    return asyncio.run(coro)


async def admission() -> tuple[Admission, aioredis.Redis]:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    return Admission(client), client


async def acquire(
    adm: Admission,
    model: int,
    budget: int,
    rid: str,
    prio: str,
    tenant: int,
    cost: int,
    gone: asyncio.Event | None = None,
) -> object:
    """As the gateway does: the request on record as open, one try at admission (which
    queues the request), then wait."""
    claim = Claim(rid, model, budget, prio, tenant, weight=1, cost=cost)
    await adm.redis.zadd(open_keys()[0], {rid: int(time.time() * 1000) + 600_000})
    got, _, _ = await adm._try(claim)
    if got:
        adm.holding(rid, model)
        return Ticket(True, 0.0)
    return await adm.wait(claim, gone or asyncio.Event())


@pytest.mark.parametrize(
    ("tenant", "asked", "expected"),
    [
        ("P1", None, "P1"),
        ("P1", "P2", "P2"),
        ("P1", "p2", "P2"),
        ("P1", "P0", "P1"),
        ("P2", "P0", "P2"),
        ("P0", 2, "P2"),
        ("P1", "nonsense", "P1"),
        ("P1", True, "P1"),
    ],
)
def test_a_request_may_lower_its_class_never_raise_it(
    tenant: str, asked: object, expected: str
) -> None:
    assert lowered(tenant, asked) == expected


def test_slots_go_by_class_then_fair_share() -> None:
    async def scenario() -> list[str]:
        adm, client = await admission()
        never = asyncio.Event()
        model = 900001
        try:
            assert (await acquire(adm, model, 1, "holder", "P1", 1, 10, never)).admitted
            order: list[str] = []

            async def wait(rid: str, prio: str, tenant: int) -> None:
                ticket = await acquire(adm, model, 1, rid, prio, tenant, 100, never)
                assert ticket.admitted
                order.append(rid)
                await asyncio.sleep(0.05)
                await client.zrem(pool_keys(model)[0], rid)  # as settle does
                adm.finished(rid, model, 0.05)
                adm.wake_local(model)

            tasks = []
            for rid, prio, tenant in [
                ("b1", "P2", 2),
                ("p1-t1-a", "P1", 1),
                ("p1-t1-b", "P1", 1),
                ("p1-t1-c", "P1", 1),
                ("p1-t3-a", "P1", 3),
                ("p0", "P0", 4),
            ]:
                tasks.append(asyncio.create_task(wait(rid, prio, tenant)))
                await asyncio.sleep(0.02)  # arrival order
            await client.zrem(pool_keys(model)[0], "holder")
            adm.wake_local(model)
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            return order
        finally:
            await client.delete(*pool_keys(model))
            await client.aclose()

    order = run(scenario())
    assert order[0] == "p0" and order[-1] == "b1"
    p1 = order[1:-1]
    # Tenant 3 arrived after three of tenant 1's requests, but tenant 1 had already used
    # tokens (the holder's): fair share serves tenant 3 first, not after tenant 1's burst.
    assert p1 == ["p1-t3-a", "p1-t1-a", "p1-t1-b", "p1-t1-c"]


def test_the_pool_and_the_waits_as_the_console_reads_them() -> None:
    """pool_status counts waiters by class from the queue the Lua scripts keep (whose rank
    encoding only gateway/admission.py knows); wait_stats sums the waits by class and tenant."""

    async def scenario() -> None:
        adm, client = await admission()
        model, gone = 900011, asyncio.Event()
        try:
            assert (await acquire(adm, model, 1, "holder", "P1", 1, 10)).admitted
            waiters = [
                asyncio.create_task(acquire(adm, model, 1, rid, prio, tenant, 100, gone))
                for rid, prio, tenant in (
                    ("a", "P2", 97),
                    ("b", "P0", 98),
                    ("c", "P2", 97),
                    ("d", "P1", 97),
                )
            ]
            deadline = time.monotonic() + 10
            while await client.zcard(pool_keys(model)[1]) < 4:
                assert time.monotonic() < deadline, "the waiters never queued"
                await asyncio.sleep(0.01)
            status = await asyncio.to_thread(pool_status, model, 1)
            assert (status.ceiling, status.running) == (1, 1)
            assert status.waiting == {"P0": 1, "P1": 1, "P2": 2}
            gone.set()  # every waiter's client goes away
            assert not any(t.admitted for t in await asyncio.gather(*waiters))
            stats = {
                (w.priority, w.tenant_id): w.count
                for w in await asyncio.to_thread(wait_stats)
                if w.tenant_id in (97, 98)
            }  # the module's tests share one Redis prefix
            assert stats == {("P2", 97): 2, ("P0", 98): 1, ("P1", 97): 1}
        finally:
            await client.delete(*pool_keys(model))
            await client.aclose()

    run(scenario())


def test_p2_waits_while_engines_have_no_spare_capacity_and_times_out_with_retry_after(
    settings: object,
) -> None:
    settings.TOLLGATE_QUEUE_TIMEOUT_SECONDS = {"P0": 1, "P1": 1, "P2": 1}

    async def scenario() -> tuple[object, object]:
        adm, client = await admission()
        model = 900002
        try:
            adm.p2_open[model] = False
            started = time.monotonic()
            batch = await acquire(adm, model, 4, "batch", "P2", 1, 10)
            waited = time.monotonic() - started
            standard = await acquire(adm, model, 4, "std", "P1", 1, 10)
            leftovers = await client.zcard(pool_keys(model)[1])
            return batch, waited, standard, leftovers
        finally:
            await client.delete(*pool_keys(model))
            await client.aclose()

    batch, waited, standard, leftovers = run(scenario())
    assert not batch.admitted and batch.retry_after >= 1 and 0.9 < waited < 3
    assert standard.admitted  # the free slots were there all along: only P2 was held back
    assert leftovers == 0  # a timed-out request leaves the queue


def test_a_dead_gateways_slot_lease_lapses() -> None:
    async def scenario() -> bool:
        adm, client = await admission()
        model = 900003
        try:
            assert (await acquire(adm, model, 1, "ghost", "P1", 1, 10)).admitted
            # The gateway holding "ghost" died: nobody renews its lease.
            await client.zadd(pool_keys(model)[0], {"ghost": int(time.time() * 1000) - 1})
            return (await acquire(adm, model, 1, "next", "P1", 1, 10)).admitted
        finally:
            await client.delete(*pool_keys(model))
            await client.aclose()

    assert run(scenario())


def test_controller_stays_within_the_budget_and_takes_back_steps_that_did_not_pay() -> None:
    state = ControllerState(ceiling=8)
    # Demand waits, the ceiling is at the budget: nothing to gain by letting more in.
    state, why = next_ceiling(state, Sample(100.0, 0.2, 0, 5), budget=8)
    assert (why, state.ceiling) == ("hold", 8)
    # The engine's TTFT climbs to 4.5x its best: one step down.
    state, why = next_ceiling(state, Sample(100.0, 0.9, 0, 5), budget=8)
    assert (why, state.ceiling) == ("decrease", 7)
    # That step cost throughput (> 5 %): taken back.
    state, why = next_ceiling(state, Sample(80.0, 0.25, 0, 5), budget=8)
    assert (why, state.ceiling) == ("revert", 8)
    # The engine queues requests itself: one fewer; a decrease that costs nothing stays.
    state, why = next_ceiling(state, Sample(80.0, 0.2, 2, 5), budget=8)
    assert (why, state.ceiling) == ("decrease", 7)
    state, why = next_ceiling(
        state, Sample(80.0, 0.2, 0, 5), budget=8
    )  # cost nothing, demand waits
    assert (why, state.ceiling) == ("increase", 8)
    # An increase that bought no throughput is taken back.
    state = ControllerState(ceiling=6, last_tokens_per_second=100.0)
    state, why = next_ceiling(state, Sample(100.0, 0.2, 0, 3), budget=8)
    assert (why, state.ceiling) == ("increase", 7)
    state, why = next_ceiling(state, Sample(100.5, 0.2, 0, 3), budget=8)
    assert (why, state.ceiling) == ("revert", 6)
    # Bounds: never below 1, never above the budget.
    for _ in range(20):
        state, _ = next_ceiling(state, Sample(1.0, 5.0, 9, 9), budget=8)
    assert state.ceiling == 1
    state = ControllerState(ceiling=8)
    for tps in range(100, 140):
        state, _ = next_ceiling(state, Sample(float(tps * 10), 0.2, 0, 9), budget=8)
    assert state.ceiling == 8


def test_a_queue_entry_whose_request_is_closed_holds_up_nobody() -> None:
    """A request that settled (or whose gateway died) while still queued, e.g. after an error
    or a cancellation, leaves no entry that keeps the requests behind it waiting until its
    give-up time (minutes): the next request's try drops it."""

    async def scenario() -> None:
        adm, client = await admission()
        model = 9111
        running, queue, expiry, *_ = pool_keys(model)
        assert (await acquire(adm, model, 1, "holder", "P2", 1, 10)).admitted
        waiting = await queued(adm, model, "ghost", tenant=1)
        behind = await queued(adm, model, "behind", tenant=2)
        # The first waiter's request ends without its wait cleaning up (its task is gone)
        # and its open record is closed, as settling does.
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await client.zadd(queue, {"ghost": 1.0})  # put back, as a lost cleanup would leave it
        await client.zadd(expiry, {"ghost": int(time.time() * 1000) + 600_000})
        await client.zrem(open_keys()[0], "ghost")
        await client.zrem(running, "holder")  # the slot frees
        ticket = await asyncio.wait_for(behind, 10)
        assert ticket.admitted
        assert await client.zscore(queue, "ghost") is None
        await client.aclose()

    run(scenario())


def test_a_cancelled_wait_leaves_the_queue() -> None:
    async def scenario() -> None:
        adm, client = await admission()
        model = 9112
        _, queue, expiry, *_ = pool_keys(model)
        assert (await acquire(adm, model, 1, "holder", "P2", 1, 10)).admitted
        waiting = await queued(adm, model, "cancelled", tenant=1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert await client.zscore(queue, "cancelled") is None
        assert await client.zscore(expiry, "cancelled") is None
        await client.aclose()

    run(scenario())


async def queued(adm: Admission, model: int, rid: str, tenant: int) -> asyncio.Task:
    """A P2 request of one slot's model, waiting in the queue (the slot is held)."""
    task = asyncio.create_task(acquire(adm, model, 1, rid, "P2", tenant, 10))
    await wait_for(lambda: adm.redis.zscore(pool_keys(model)[1], rid))
    return task


async def wait_for(probe: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await probe():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)
