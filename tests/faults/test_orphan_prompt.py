"""A gateway killed with SIGKILL after its engine took requests but before any usage came
back: each taken request is billed its prompt exactly once (the engine's tokenizer where the
open record kept what to ask it, else the estimate, marked); a request still queued for an
engine slot is billed nothing."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import httpx
import orjson
import pytest

from core.keyspace import open_keys, quota_key, usage_stream
from core.redis import get_redis
from core.usage import UsageRecord
from gateway import tasks
from gateway.billing import RECORDED_PROMPT_BYTES, estimate_prompt
from metering.periods import period_id
from tests.faults.conftest import Gateway, build_world, start_engine, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

SYSTEM = "You are a careful assistant who answers in one short sentence."
CHAT = {
    "model": "sim-chat",
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}],
    "max_tokens": 16,
    "stream": True,
}
RESPONSES = {
    "model": "sim-chat",
    "instructions": SYSTEM,
    "input": "What is a kilowatt-hour?",
    "max_output_tokens": 16,
    "stream": True,
}
MESSAGES = {
    "model": "sim-chat",
    "system": SYSTEM,
    "messages": [{"role": "user", "content": "Name a prime number."}],
    "max_tokens": 16,
}
# Longer than the open record keeps: only its estimate survives the gateway.
LONG = {
    "model": "sim-chat",
    "prompt": "the quick brown fox jumps over the lazy dog " * (RECORDED_PROMPT_BYTES // 40),
    "max_tokens": 16,
}
QUEUED = {**CHAT, "messages": [{"role": "user", "content": "I wait for a slot."}]}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
SENT = [
    ("chat", "/v1/chat/completions", CHAT),
    ("responses", "/v1/responses", RESPONSES),
    ("messages", "/v1/messages", MESSAGES),
    ("completions", "/v1/completions", LONG),
]


def post_forever(url: str, key: str, body: dict) -> None:
    """A client that waits for an answer that never comes (its gateway dies)."""
    try:
        httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    except httpx.HTTPError:
        pass


def engine_running(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
    )


def open_records() -> dict[str, dict]:
    return {
        rid.decode(): orjson.loads(raw) for rid, raw in get_redis().hgetall(open_keys()[1]).items()
    }


def billed() -> dict[str, UsageRecord]:
    every = [UsageRecord.decode(f[b"e"]) for _, f in get_redis().xrange(usage_stream())]
    return {e.request_id: e for e in every}


def test_kill_9_after_the_engine_took_requests_bills_each_prompt_once(procs, gateway_env) -> None:
    # A prefill of a minute: no usage, no token reaches the gateway before it dies.
    engine = start_engine(
        procs, ("sim-chat",), "--sim-ttft-ms", "60000", "--max-model-len", "32768"
    )
    world = build_world(
        engine.port,
        tenant_a={
            "requests_per_minute": None,
            "max_concurrent_requests": None,
            "tokens_per_minute": None,
            "quota_tokens": 10**9,
            "quota_period": "daily",
        },
    )
    world.chat.context_length = 32768
    world.chat.save(update_fields=["context_length"])
    dep = world.deployments[0]
    dep.engine_args = {"max-num-seqs": len(SENT)}  # the next request queues for a slot
    dep.save(update_fields=["engine_args"])
    gw = Gateway(procs, gateway_env(TOLLGATE_GATEWAY_LEASE_SECONDS="2")).start()
    gw.wait_ready(world.key_a)

    for _, path, body in SENT:
        threading.Thread(
            target=post_forever, args=(gw.url + path, world.key_a, body), daemon=True
        ).start()
    wait_for(lambda: engine_running(engine.url) == len(SENT), 30, "the engine to take 4 requests")
    threading.Thread(
        target=post_forever, args=(gw.url + PATHS["chat"], world.key_a, QUEUED), daemon=True
    ).start()
    wait_for(lambda: len(open_records()) == len(SENT) + 1, 30, "the fifth request to queue")
    records = open_records()
    gw.kill9()

    def all_billed() -> bool:
        tasks.reap_orphans()
        return set(billed()) >= set(records)

    wait_for(all_billed, 30, "every open request to be reaped")
    events = billed()
    by_what = {}
    for rid, record in records.items():
        event = events[rid]
        assert (event.completion_tokens, event.status) == (0, "error")
        queued = b"I wait for a slot" in orjson.dumps(record["prompt"])
        by_what["queued" if queued else record["event"]["endpoint"]] = event
    assert set(by_what) == {"chat", "responses", "messages", "completions", "queued"}

    tokenize = httpx.post(
        f"{engine.url}/tokenize",
        json={"model": "sim-chat", "messages": CHAT["messages"]},
        timeout=5,
    ).json()["count"]
    assert (by_what["chat"].prompt_tokens, by_what["chat"].prompt_estimated) == (tokenize, False)
    counted = httpx.post(
        f"{engine.url}/v1/messages/count_tokens",
        json={k: MESSAGES[k] for k in ("model", "system", "messages")},
        timeout=5,
    ).json()["input_tokens"]
    assert (by_what["messages"].prompt_tokens, by_what["messages"].prompt_estimated) == (
        counted,
        False,
    )
    as_chat = httpx.post(
        f"{engine.url}/tokenize",
        json={
            "model": "sim-chat",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": RESPONSES["input"]},
            ],
        },
        timeout=5,
    ).json()["count"]
    assert by_what["responses"].prompt_tokens == as_chat
    assert not by_what["responses"].prompt_estimated
    # The long prompt: the estimate, and the ledger says so.
    assert by_what["completions"].prompt_tokens == estimate_prompt(LONG)
    assert by_what["completions"].prompt_estimated
    # Never sent to an engine: nothing to pay.
    assert by_what["queued"].prompt_tokens == 0 and not by_what["queued"].prompt_estimated

    # Once: another reap finds nothing, the stream holds one event per request.
    tasks.reap_orphans()
    ids = [orjson.loads(f[b"e"])["request_id"] for _, f in get_redis().xrange(usage_stream())]
    assert sorted(ids) == sorted(set(ids))
    quota = get_redis().hgetall(quota_key(world.tenant_a.pk, period_id("daily", datetime.now(UTC))))
    assert int(quota[b"tokens_reserved"]) == 0
    assert int(quota[b"tokens_used"]) == sum(e.prompt_tokens for e in by_what.values())
