"""Admission rules in acquire.lua, run in the real Redis with the clock passed in: headroom
for higher classes, admission by predicted tokens against the KV cache, their release."""

import orjson
import pytest

from core.keyspace import pool_keys
from core.redis import get_redis
from gateway.admission import RETRY_LUA
from gateway.limiter import SETTLE_LUA

MODEL = 880001
T0 = 1_800_000_000_000  # ms; every call passes its own clock
WINDOW = 5000
CHANNEL = "test-preempt-channel"
CLASSES = {"P0": 0, "P1": 1, "P2": 2}


@pytest.fixture(autouse=True)
def empty_pool() -> None:
    """The gateway tests share one Redis prefix: each test starts from an empty pool."""

    def clean() -> None:
        client = get_redis()
        client.delete(*pool_keys(MODEL))
        for key in client.scan_iter(f"{pool_keys(MODEL)[0]}:x:*"):
            client.delete(key)

    clean()
    yield
    clean()


def take(
    rid: str,
    cls: str,
    now: int,
    *,
    budget: int = 4,
    kv: int = 100,
    kvcap: int = 0,
    hwin: int = WINDOW,
    hmax: int = 2,
    lease: int = 60_000,
    preempt: int = 0,
    victim: int = 0,
    head: int = 0,
) -> bool:
    """One try for a slot, as a queued request makes it; True when it got one. A request
    that did not get one leaves the queue again, so the next try ranks on its own."""
    args = [rid, CLASSES[cls], "7", 1, 10, now, lease, budget, "1", 60_000, kv, kvcap]
    args += [hwin, hmax, preempt, victim, head, CHANNEL]
    client = get_redis()
    pool = pool_keys(MODEL)
    got = client.eval(RETRY_LUA, len(pool), *pool, orjson.dumps(args))[0] == 1
    if not got:
        client.zrem(pool_keys(MODEL)[1], rid)
        client.zrem(pool_keys(MODEL)[2], rid)
    return got


def release(rid: str) -> None:
    """settle.lua's part that frees the slot and what the request held."""
    pool = pool_keys(MODEL)
    own = [f"{pool[0]}:x:{name}" for name in ("k", "t", "kc", "tc", "q", "s", "settled-" + rid)]
    keys = [*own, pool[0], pool[1]]
    keys += [f"{pool[0]}:x:{name}" for name in ("open", "rec", "cp")] + [pool[5], pool[7]]
    args = [rid, 0, 0, 0, 0, "", "wake", MODEL]
    get_redis().eval(SETTLE_LUA, len(keys), *keys, orjson.dumps(args))


def held() -> dict[str, int]:
    raw = get_redis().hgetall(pool_keys(MODEL)[5])
    return {k.decode(): int(v) for k, v in raw.items() if k.startswith(b"_")}


def fill(cls: str, now: int, count: int, **kw: object) -> int:
    """Admit up to ``count`` requests of a class; how many got a slot."""
    return sum(take(f"{cls}-{now}-{i}", cls, now, **kw) for i in range(count))


def test_p2_fills_every_slot_while_no_higher_class_came() -> None:
    assert fill("P2", T0, 5) == 4


def test_p2_leaves_the_slot_a_recent_p0_needed_and_takes_it_back_later() -> None:
    assert take("p0-a", "P0", T0)
    release("p0-a")  # it finished: nothing of P0 runs now, but it came recently
    assert fill("P2", T0 + 100, 5) == 3  # the last slot stays free for P0
    assert take("p0-b", "P0", T0 + 200)  # and P0 finds it
    # Two windows without P0: the headroom is gone, P2 may fill the box again.
    release("p0-b")
    assert fill("P2", T0 + 2 * WINDOW + 300, 5) == 1


def test_the_headroom_follows_how_many_p0_ran_at_once() -> None:
    assert take("p0-a", "P0", T0) and take("p0-b", "P0", T0 + 1)
    release("p0-a")
    release("p0-b")
    assert fill("P2", T0 + 10, 5) == 2  # two P0 ran at once: two slots stay free
    # A P0 running now uses one of those two: the other stays free, P2 gets none.
    assert take("p0-c", "P0", T0 + 20)
    assert not take("p2-x", "P2", T0 + 30)
    # A P2 reply ends: 1 P2 + 1 P0 running, one slot kept, so P2 may take one again.
    release(f"P2-{T0 + 10}-0")
    assert take("p2-y", "P2", T0 + 40)
    assert held() == {"_tok": 300, "_c0": 1, "_c2": 2}


def test_p1_leaves_room_for_p0_and_p2_for_both() -> None:
    assert take("p1-a", "P1", T0)
    assert take("p0-a", "P0", T0 + 1)
    release("p1-a")
    release("p0-a")
    # P2 sees two higher-class requests at once (one P0, one P1): two slots stay free.
    assert fill("P2", T0 + 10, 5) == 2
    # P1 only leaves the one P0 needed.
    assert fill("P1", T0 + 20, 5) == 1


def test_a_p0_request_that_had_to_wait_counts_as_demand() -> None:
    assert fill("P2", T0, 4) == 4  # no P0 came recently: P2 took every slot
    assert not take("p0-a", "P0", T0 + 10)  # P0 finds none and waits
    release(f"P2-{T0}-0")
    assert take("p0-a", "P0", T0 + 20)  # the freed slot goes to it
    release("p0-a")
    release(f"P2-{T0}-1")
    # P2 now leaves one slot free: 2 P2 running, one more may start, not two.
    assert fill("P2", T0 + 30, 2) == 1


def test_the_headroom_is_capped() -> None:
    for i in range(4):
        assert take(f"p0-{i}", "P0", T0 + i)
    for i in range(4):
        release(f"p0-{i}")
    assert fill("P2", T0 + 10, 5, hmax=1) == 3


def test_predicted_tokens_are_held_against_the_kv_cache() -> None:
    # Long-context requests: two fit in 10,000 tokens, the third waits (four slots free).
    assert fill("P1", T0, 3, kv=4000, kvcap=10_000, hwin=0) == 2
    assert held()["_tok"] == 8000
    # Short requests still fill the remaining slots.
    assert fill("P1", T0 + 1, 3, kv=500, kvcap=10_000, hwin=0) == 2
    assert held() == {"_tok": 9000, "_c1": 4}


def test_a_request_larger_than_the_cache_runs_alone() -> None:
    assert take("huge", "P1", T0, kv=50_000, kvcap=10_000, hwin=0)
    assert not take("small", "P1", T0 + 1, kv=10, kvcap=10_000, hwin=0)
    release("huge")
    assert take("small", "P1", T0 + 2, kv=10, kvcap=10_000, hwin=0)


def test_settling_and_lapsed_leases_release_what_requests_held() -> None:
    assert take("a", "P0", T0, kv=3000, kvcap=10_000)
    assert take("b", "P2", T0, kv=2000, kvcap=10_000, lease=1000)
    assert take("d", "P1", T0, kv=1000, kvcap=10_000)
    assert held() == {"_tok": 6000, "_c0": 1, "_c1": 1, "_c2": 1}
    release("a")
    release("a")  # a retried settle releases nothing twice
    assert held() == {"_tok": 3000, "_c0": 0, "_c1": 1, "_c2": 1}
    # b's gateway died: its lease lapses, and what it held goes with it, so c fits.
    assert take("c", "P1", T0 + 5000, kv=7500, kvcap=10_000)
    assert held() == {"_tok": 8500, "_c0": 0, "_c1": 2, "_c2": 0}


@pytest.mark.parametrize("hwin", [0, WINDOW])
def test_p0_is_never_held_back_by_the_headroom(hwin: int) -> None:
    assert fill("P0", T0, 5, hwin=hwin) == 4


def test_the_headroom_never_keeps_every_slot() -> None:
    assert take("p0-a", "P0", T0, budget=2)
    release("p0-a")
    assert fill("P2", T0 + 10, 2, budget=2, hmax=2) == 1


def running() -> set[str]:
    return {m.decode() for m in get_redis().zrange(pool_keys(MODEL)[0], 0, -1)}


def test_p0_takes_the_youngest_preemptible_p2_slot_at_once() -> None:
    for i in range(4):
        assert take(f"p2-{i}", "P2", T0 + i, victim=1)
    pubsub = get_redis().pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(CHANNEL)
    assert not take("p0-late", "P0", T0 + 10)  # a P0 that may not preempt waits
    assert take("p0", "P0", T0 + 10, preempt=1)
    assert running() == {"p2-0", "p2-1", "p2-2", "p0"}
    assert held()["_c2"] == 3 and held()["_c0"] == 1 and held()["_tok"] == 400
    told = [pubsub.get_message(timeout=0.2) for _ in range(10)]  # the first: subscribed
    assert [m["data"] for m in told if m] == [b"p2-3"]  # its gateway process is told
    pubsub.close()


def judged_to_free(until: int = T0 + 600_000) -> None:
    """The controller's verdict on the model: preempting frees an engine slot (gateway/
    tuning.py note_verdict), so admission preempts as often as P0 needs."""
    get_redis().hset(pool_keys(MODEL)[8], "frees", until)


def test_a_preempted_request_comes_back_ahead_of_its_class_and_is_the_last_victim() -> None:
    """The victim heads its class when it comes back, but leaves the slot P0 needed a
    moment ago free like every P2 request: the next P0 finds it and preempts nobody."""
    judged_to_free()
    for i in range(4):
        assert take(f"p2-{i}", "P2", T0 + i, victim=1)
    assert take("p0", "P0", T0 + 10, preempt=1)  # p2-3 preempted
    release("p0")
    assert not take("p2-3", "P2", T0 + 12, victim=1, head=1)  # the headroom's slot
    assert take("p0-2", "P0", T0 + 14, preempt=1)
    assert running() == {"p2-0", "p2-1", "p2-2", "p0-2"}  # nobody was preempted for it
    release("p0-2")
    release("p2-0")
    assert take("p2-3", "P2", T0 + 15, victim=1, head=1)  # one slot beyond the headroom
    assert not take("p2-new", "P2", T0 + 16, victim=1)
    assert take("p0-3", "P0", T0 + 17, preempt=1)
    assert take("p0-4", "P0", T0 + 18, preempt=1)
    assert "p2-3" in running() and "p2-2" not in running()  # the youngest not yet resumed


def test_a_request_that_may_not_be_preempted_keeps_its_slot() -> None:
    for i in range(4):
        assert take(f"p2-{i}", "P2", T0 + i)  # not preemptible (Responses, Messages, ...)
    assert not take("p0", "P0", T0 + 10, preempt=1)
    assert running() == {"p2-0", "p2-1", "p2-2", "p2-3"}


def test_preemptible_requests_keep_the_headroom_too() -> None:
    """Preempting throws work away, so a P2 request that may be preempted still leaves the
    slot a recent P0 needed: the next P0 finds it free and preempts nobody."""
    assert take("p0", "P0", T0, preempt=1)
    release("p0")
    for i in range(3):
        assert take(f"p2-{i}", "P2", T0 + 1 + i, victim=1)
    assert not take("p2-3", "P2", T0 + 5, victim=1)  # the slot P0 needed stays free
    pubsub = get_redis().pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(CHANNEL)
    assert take("p0-2", "P0", T0 + 6, preempt=1)
    assert running() == {"p2-0", "p2-1", "p2-2", "p0-2"}
    told = [pubsub.get_message(timeout=0.2) for _ in range(5)]
    assert not [m for m in told if m]  # nobody was preempted
    pubsub.close()


def test_until_preempting_is_judged_to_free_a_slot_it_happens_once_per_window() -> None:
    """On probation (no verdict yet, or the last one expired) a second P0 within 30 s waits
    instead of preempting: an engine that finishes what the gateway aborts meets one request
    it did not count before the controller can tell, not one per P0 arrival."""
    LONG = 600_000  # leases that outlive the test's minute
    for i in range(4):
        assert take(f"p2-{i}", "P2", T0 + i, victim=1, lease=LONG)
    assert take("p0", "P0", T0 + 10, preempt=1, lease=LONG)  # the probe
    assert not take("p0-2", "P0", T0 + 20, preempt=1, lease=LONG)
    assert not take("p0-3", "P0", T0 + 30_009, preempt=1, lease=LONG)  # 29.999 s after the probe
    assert take("p0-4", "P0", T0 + 30_010, preempt=1, lease=LONG)  # the next window's probe
    assert not take("p0-5", "P0", T0 + 30_020, preempt=1, lease=LONG)
    judged_to_free(until=T0 + 60_000)  # the controller saw a slot freed
    assert take("p0-6", "P0", T0 + 30_030, preempt=1, lease=LONG)
    assert running() == {"p2-0", "p0", "p0-4", "p0-6"}
    # The verdict lapsed: on probation again (p0-6 preempted 29.971 s ago), then the probe.
    assert not take("p0-7", "P0", T0 + 60_001, preempt=1, lease=LONG)
    assert take("p0-8", "P0", T0 + 60_030, preempt=1, lease=LONG)
    assert running() == {"p0", "p0-4", "p0-6", "p0-8"}
