"""End to end through the official openai SDK: gateway in front of simulator engines."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from core.keyspace import usage_stream
from core.redis import get_redis
from core.usage import UsageRecord
from tenants import services as tenant_services
from tenants.choices import TenantStatus
from tests.gateway.conftest import World, wait_until_refused

pytestmark = pytest.mark.django_db(transaction=True)
HELLO = [{"role": "user", "content": "Say hello to the gateway tests."}]


def client(world: World, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=world.v1, api_key=key or world.key_a, max_retries=0)


def usage_event(request_id: str, timeout: float = 30.0) -> UsageRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, fields in get_redis().xrange(usage_stream()):
            record = UsageRecord.decode(fields[b"e"])
            if record.request_id == request_id:
                return record
        time.sleep(0.05)
    raise AssertionError(f"no usage event for {request_id}")


def direct(engine_url: str, payload: dict) -> dict:
    return httpx.post(f"{engine_url}/v1/chat/completions", json=payload, timeout=10).json()


def test_chat_answer_and_usage_are_the_engines_and_metered_once(
    world: World, engines: dict
) -> None:
    raw = client(world).chat.completions.with_raw_response.create(
        model="sim-chat", messages=HELLO, max_tokens=12
    )
    reply = raw.parse()
    expected = direct(
        engines["chat"].url, {"model": "sim-chat", "messages": HELLO, "max_tokens": 12}
    )
    assert reply.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert reply.usage.completion_tokens == expected["usage"]["completion_tokens"] == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    request_id = raw.headers["x-request-id"]
    event = usage_event(request_id)
    assert (event.prompt_tokens, event.completion_tokens) == (reply.usage.prompt_tokens, 12)
    assert (
        event.tenant_id == world.tenant_a.pk and event.status == "ok" and event.price_id is not None
    )
    assert int(raw.headers["x-ratelimit-limit-requests"]) == 600
    assert int(raw.headers["x-ratelimit-remaining-requests"]) == 599


def test_stream_matches_the_engine_and_strips_usage_not_asked_for(
    world: World, engines: dict
) -> None:
    chunks = list(
        client(world).chat.completions.create(
            model="sim-chat", messages=HELLO, max_tokens=9, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = direct(
        engines["chat"].url, {"model": "sim-chat", "messages": HELLO, "max_tokens": 9}
    )
    assert text == expected["choices"][0]["message"]["content"]
    assert all(c.usage is None for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_with_include_usage_ends_with_the_usage_chunk(world: World) -> None:
    chunks = list(
        client(world).chat.completions.create(
            model="sim-chat",
            messages=HELLO,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.usage is not None for c in chunks].count(True) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    continuous = list(
        client(world).chat.completions.create(
            model="sim-chat",
            messages=HELLO,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in continuous)


def test_completions_and_embeddings(world: World) -> None:
    c = client(world)
    completion = c.completions.create(model="sim-chat", prompt="Once upon a time", max_tokens=6)
    assert completion.choices[0].text and completion.usage.completion_tokens == 6
    first = c.embeddings.create(model="sim-embed", input="the same text")
    again = c.embeddings.create(model="sim-embed", input="the same text")
    assert first.data[0].embedding == again.data[0].embedding and len(first.data[0].embedding) > 0
    assert first.usage.prompt_tokens > 0


def test_async_client_streaming_and_not(world: World) -> None:
    async def run() -> tuple[str, int]:
        async with openai.AsyncOpenAI(base_url=world.v1, api_key=world.key_b, max_retries=0) as c:
            reply = await c.chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=4)
            stream = await c.chat.completions.create(
                model="sim-chat", messages=HELLO, max_tokens=4, stream=True
            )
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            return text, reply.usage.completion_tokens

    text, tokens = asyncio.run(run())
    assert text and tokens == 4


def test_sdk_error_classes(world: World) -> None:
    c = client(world)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=999_999)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.AuthenticationError) as unauthorized:
        client(world, "tg-aaaaaaaa-" + "b" * 40).chat.completions.create(
            model="sim-chat", messages=HELLO
        )
    assert unauthorized.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as missing:
        c.chat.completions.create(model="no-such-model", messages=HELLO)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        c.chat.completions.create(
            model="sim-chat", messages=[{"role": "user", "content": "word " * 5000}], max_tokens=5
        )
    assert long_prompt.value.code == "context_length_exceeded"


def test_another_tenants_private_model_is_indistinguishable_from_a_missing_one(
    world: World,
) -> None:
    assert (
        client(world)
        .chat.completions.create(model="acme-private", messages=HELLO, max_tokens=2)
        .choices
    )
    b = client(world, world.key_b)
    assert "acme-private" not in [m.id for m in b.models.list()]
    bodies = []
    for name in ("acme-private", "acme-nothing"):
        r = httpx.post(
            f"{world.v1}/chat/completions",
            headers={"Authorization": f"Bearer {world.key_b}"},
            json={"model": name, "messages": HELLO},
        )
        assert r.status_code == 404
        bodies.append(r.json()["error"]["message"].replace(name, "X"))
    assert bodies[0] == bodies[1]


def test_every_bad_credential_gets_the_same_401_body(world: World) -> None:
    revoked = tenant_services.issue_api_key(None, world.tenant_a, name="soon revoked")
    tenant_services.revoke_api_key(None, revoked.key)
    wait_until_refused(world.url, revoked.plaintext)
    variants = [
        {"Authorization": f"Bearer {revoked.plaintext}"},
        {"Authorization": "Bearer ' OR '1'='1"},
        {"Authorization": f"Basic {world.key_a}"},
        {"Authorization": "Bearer " + "x" * 10_000},
        {},
        {"api-key": "tg-00000000-" + "0" * 40},
        # The right key with its last character changed (never to itself).
        {"Authorization": f"Bearer {world.key_a[:-1]}{'Z' if world.key_a[-1] != 'Z' else 'Y'}"},
    ]
    bodies = {
        httpx.post(
            f"{world.v1}/chat/completions", headers=h, json={"model": "sim-chat", "messages": HELLO}
        ).content
        for h in variants
    }
    assert len(bodies) == 1 and b"invalid_api_key" in bodies.pop()
    ok = httpx.post(
        f"{world.v1}/chat/completions",
        headers={"api-key": world.key_a},
        json={"model": "sim-chat", "messages": HELLO, "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_revocation_and_suspension_take_effect_within_a_second(world: World) -> None:
    c = client(world)
    assert c.chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=1)
    tenant_services.set_tenant_status(None, world.tenant_a, TenantStatus.SUSPENDED)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        r = httpx.get(f"{world.v1}/models", headers={"Authorization": f"Bearer {world.key_a}"})
        if r.status_code == 401:
            break
        time.sleep(0.05)
    for _ in range(4):  # every worker
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=1)


def test_bad_input_limits(world: World) -> None:
    headers = {"Authorization": f"Bearer {world.key_a}", "content-type": "application/json"}
    r = httpx.post(f"{world.v1}/chat/completions", headers=headers, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{world.v1}/chat/completions",
        headers=headers,
        json={"model": "sim-chat", "messages": HELLO, "n": 99},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(
        f"{world.v1}/chat/completions", headers=headers, content=b"x" * (9 * 1024 * 1024)
    )
    assert r.status_code == 413
    r = httpx.post(
        f"{world.v1}/embeddings", headers=headers, json={"model": "sim-chat", "input": "x"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_redirect_fields_in_the_body_are_ignored(world: World) -> None:
    r = httpx.post(
        f"{world.v1}/chat/completions",
        headers={"Authorization": f"Bearer {world.key_a}"},
        json={
            "model": "sim-chat",
            "messages": HELLO,
            "max_tokens": 3,
            "api_base": "http://127.0.0.1:9",
            "base_url": "http://127.0.0.1:9",
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_client_disconnect_mid_stream_bills_exactly_the_tokens_delivered(
    world: World, engines: dict
) -> None:
    received = 0
    with httpx.stream(
        "POST",
        f"{world.v1}/chat/completions",
        headers={"Authorization": f"Bearer {world.key_a}"},
        json={"model": "sim-slow", "messages": HELLO, "stream": True},
    ) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = orjson.loads(line[6:])["choices"][0]["delta"]
                received += 1 if delta.get("content") else 0
            if received == 10:
                break
    event = usage_event(request_id)
    assert event.status == "client_closed"
    assert event.completion_tokens == received == 10
    assert event.prompt_tokens > 0
    # The engine stopped generating for the gone client: sim-slow pauses every stream after
    # its 10th token until released, so only the gateway's abort ends this request.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{engines['slow'].url}/metrics").text
        running = [ln for ln in metrics.splitlines() if ln.startswith("vllm:num_requests_running")]
        if running and float(running[0].split()[-1]) == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the engine kept generating after the client left")


def test_failover_when_a_replica_refuses_connections(world: World) -> None:
    from core.changes import publish_change
    from deployments.choices import ReplicaState
    from deployments.models import Replica
    from tests.gateway.conftest import free_port

    Replica.objects.create(
        deployment=world.deployment,
        index=1,
        host="127.0.0.1",
        port=free_port(),
        state=ReplicaState.READY,
        healthy=True,
    )
    publish_change("replica", 0)
    from tests.gateway.conftest import METRICS_TOKEN

    def refused() -> float:
        page = httpx.get(
            f"{world.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
        ).text
        return sum(
            float(line.split()[-1])
            for line in page.splitlines()
            if line.startswith("tollgate_upstream_errors_total{")
            and 'kind="refused"' in line
            and 'model="sim-chat"' in line
        )

    # Least-loaded routing tries the idle dead replica first once the live one has requests
    # in flight, so requests go in rounds of eight at once. Every one of them succeeds, until
    # (and after) the gateway has tried the dead replica and gone on to the live one: shown
    # by its refused-connection counter, not by a guessed sleep.
    before = refused()
    c = client(world)

    def ask(_: int) -> object:
        return c.chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=20)

    deadline = time.monotonic() + 30
    with ThreadPoolExecutor(8) as pool:
        while refused() == before:
            assert time.monotonic() < deadline, "the gateway never tried the refusing replica"
            assert all(r.choices for r in pool.map(ask, range(8)))
            time.sleep(0.2)


def test_metrics_need_the_metrics_token(world: World) -> None:
    from tests.gateway.conftest import METRICS_TOKEN

    client(world).chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=1)
    assert httpx.get(f"{world.url}/metrics").status_code == 404
    assert (
        httpx.get(
            f"{world.url}/metrics", headers={"Authorization": f"Bearer {world.key_a}"}
        ).status_code
        == 404
    )
    page = httpx.get(f"{world.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert page.status_code == 200
    assert (
        'tollgate_requests_total{endpoint="chat",model="sim-chat",status="ok",tenant="acme"}'
        in page.text
    )


def test_metrics_count_the_requests_of_every_worker(world: World) -> None:
    """The gateway runs two workers; /metrics is answered by one of them but sums both."""
    from tests.gateway.conftest import METRICS_TOKEN

    series = 'tollgate_requests_total{endpoint="chat",model="sim-chat",status="ok",tenant="acme"} '

    def served() -> float:
        page = httpx.get(
            f"{world.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
        ).text
        return next(
            (float(line.split()[-1]) for line in page.splitlines() if line.startswith(series)), 0.0
        )

    before = served()
    body = {"model": "sim-chat", "messages": HELLO, "max_tokens": 1}
    for _ in range(30):  # a new connection each: the kernel spreads them over both workers
        r = httpx.post(
            f"{world.v1}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {world.key_a}"},
        )
        assert r.status_code == 200
    # Each worker adds what it served within a second (metrics are applied in batches); a
    # loaded machine may take longer, the total must come out exact all the same.
    deadline = time.monotonic() + 30
    while served() != before + 30 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [served() for _ in range(5)] == [before + 30] * 5


def test_a_foreign_host_header_is_refused_like_django_does(world: World) -> None:
    headers = {"Authorization": f"Bearer {world.key_a}", "Host": "evil.example"}
    r = httpx.post(
        f"{world.v1}/chat/completions",
        headers=headers,
        json={"model": "sim-chat", "messages": HELLO},
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == "Invalid Host header."
    assert (
        httpx.get(f"{world.url}/api/v1/tenants/", headers={"Host": "evil.example"}).status_code
        == 400
    )
    ok = httpx.post(
        f"{world.v1}/chat/completions",
        headers={**headers, "Host": "localhost"},
        json={"model": "sim-chat", "messages": HELLO, "max_tokens": 1},
    )
    assert ok.status_code == 200
