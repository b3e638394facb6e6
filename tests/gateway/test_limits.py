"""Rate limits and quotas under real concurrency, across the gateway's two worker processes."""

import asyncio
import time
from datetime import UTC, datetime
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest

from core.keyspace import quota_key
from core.redis import get_redis
from gateway.admit import quota_reset_seconds
from metering.periods import period_id
from tenants import services as tenant_services
from tests.gateway.conftest import World, wait_until_served

pytestmark = pytest.mark.django_db(transaction=True)
HELLO = [{"role": "user", "content": "Hi"}]


async def burst(url: str, key: str, count: int, body: dict) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        start = asyncio.Event()

        async def one() -> httpx.Response:
            await start.wait()
            return await client.post(
                f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )

        tasks = [asyncio.create_task(one()) for _ in range(count)]
        await asyncio.sleep(0.2)
        start.set()
        return await asyncio.gather(*tasks)


def test_500_simultaneous_requests_on_a_60_rpm_key_admit_exactly_60(world: World) -> None:
    tenant_services.update_tenant(None, world.tenant_a, max_concurrent_requests=None)
    issued = tenant_services.issue_api_key(
        None, world.tenant_a, name="rpm60", requests_per_minute=60
    )
    wait_until_served(world.url, issued.plaintext, "sim-chat")
    responses = asyncio.run(
        burst(
            world.url,
            issued.plaintext,
            500,
            {"model": "sim-chat", "messages": HELLO, "max_tokens": 1},
        )
    )
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    # wait_until_served used none of the key's requests: /v1/models is not rate limited.
    assert len(ok) == 60 and len(limited) == 440
    for r in limited:
        assert int(r.headers["retry-after"]) > 0
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"


def test_tokens_per_minute_admit_no_more_than_one_reservation_over(world: World) -> None:
    tenant_services.update_tenant(None, world.tenant_a, max_concurrent_requests=None)
    issued = tenant_services.issue_api_key(None, world.tenant_a, name="tpm", tokens_per_minute=2000)
    wait_until_served(world.url, issued.plaintext, "sim-chat")
    responses = asyncio.run(
        burst(
            world.url,
            issued.plaintext,
            100,
            {"model": "sim-chat", "messages": HELLO, "max_tokens": 100},
        )
    )
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert ok and limited and len(ok) + len(limited) == 100
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    one_reservation = 100 + 200  # max_tokens plus a generous prompt estimate for this tiny body
    assert used <= 2000 + one_reservation
    assert all(r.json()["error"]["type"] == "tokens" for r in limited)
    assert all(int(r.headers["x-ratelimit-remaining-tokens"]) < one_reservation for r in limited)


def test_tenant_concurrency_limit_holds_across_workers(world: World) -> None:
    tenant_services.update_tenant(None, world.tenant_a, max_concurrent_requests=5)
    wait_until_served(world.url, world.key_a, "sim-chat")
    # Slow streams keep their slots long enough for the burst to collide.
    responses = asyncio.run(
        burst(world.url, world.key_a, 30, {"model": "sim-slow", "messages": HELLO, "max_tokens": 8})
    )
    assert sum(r.status_code == 200 for r in responses) == 5
    assert {
        r.json()["error"]["message"].split(" on ")[0] for r in responses if r.status_code == 429
    } == {"Rate limit reached for concurrent requests"}


def test_money_budget_cannot_be_overrun_by_more_than_one_reservation(world: World) -> None:
    # Prices are 1.00 / 2.00 per 1M tokens: budget room for roughly 20 small requests.
    budget = Decimal("0.0060")
    tenant_services.update_tenant(
        None, world.tenant_b, quota_amount=budget, max_concurrent_requests=None
    )
    wait_until_served(world.url, world.key_b, "sim-chat")
    responses = asyncio.run(
        burst(
            world.url, world.key_b, 200, {"model": "sim-chat", "messages": HELLO, "max_tokens": 100}
        )
    )
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert ok and refused
    assert {r.json()["error"]["code"] for r in refused} == {"insufficient_quota"}
    billed_nano = sum(
        r.json()["usage"]["prompt_tokens"] * 1000 + r.json()["usage"]["completion_tokens"] * 2000
        for r in ok
    )
    one_reservation_nano = (200 * 1000) + (100 * 2000)
    assert billed_nano <= int(budget * Decimal(1e9)) + one_reservation_nano
    # Nothing stays reserved once the burst is over.
    from django.utils import timezone

    quota = get_redis().hgetall(
        quota_key(world.tenant_b.pk, period_id(world.tenant_b.quota_period, timezone.now()))
    )
    assert int(quota[b"tokens_reserved"]) == 0 and int(quota[b"money_reserved"]) == 0
    assert int(quota[b"money_used"]) == billed_nano


def test_the_sdk_raises_rate_limit_error_with_retry_after(world: World) -> None:
    import openai

    issued = tenant_services.issue_api_key(
        None, world.tenant_a, name="one-a-minute", requests_per_minute=1
    )
    wait_until_served(world.url, issued.plaintext, "sim-chat")
    client = openai.OpenAI(base_url=world.v1, api_key=issued.plaintext, max_retries=0)
    client.chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=1)
    assert limited.value.code == "rate_limit_exceeded"
    retry_after = int(limited.value.response.headers["retry-after"])
    assert 50 <= retry_after <= 60  # the first request leaves the window a minute after it came


def test_an_exhausted_quota_says_when_the_period_resets_to_both_sdks(world: World) -> None:
    """The 429 insufficient_quota carries Retry-After: the seconds until the quota period
    (here daily: midnight UTC) resets, on /v1 in OpenAI's shape and on /v1/messages in
    Anthropic's; and tells the SDKs not to retry on their own."""
    tenant_services.update_tenant(None, world.tenant_b, quota_tokens=1, quota_period="daily")
    client = openai.OpenAI(base_url=f"{world.url}/v1", api_key=world.key_b, max_retries=0)
    deadline = time.monotonic() + 10
    while True:  # until both gateway workers have the new quota
        try:
            client.chat.completions.create(model="sim-chat", messages=HELLO, max_tokens=4)
        except openai.RateLimitError as exc:
            refused = exc
            break
        assert time.monotonic() < deadline, "the quota never took effect"
    until_midnight = quota_reset_seconds("daily", time.time())
    assert refused.code == "insufficient_quota"
    assert abs(int(refused.response.headers["retry-after"]) - until_midnight) <= 5
    assert refused.response.headers["x-should-retry"] == "false"

    claude = anthropic.Anthropic(base_url=world.url, api_key=world.key_b, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as caught:
        claude.messages.create(model="sim-chat", max_tokens=4, messages=HELLO)
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert "quota" in caught.value.body["error"]["message"]
    until_midnight = quota_reset_seconds("daily", time.time())
    assert abs(int(caught.value.response.headers["retry-after"]) - until_midnight) <= 5
    assert caught.value.response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    ("period", "now", "seconds"),
    [
        ("daily", datetime(2026, 11, 26, 23, 59, 30, tzinfo=UTC), 30),
        ("weekly", datetime(2026, 11, 29, 23, 0, 0, tzinfo=UTC), 3600),  # a Sunday
        ("monthly", datetime(2026, 12, 31, 0, 0, 0, 500_000, tzinfo=UTC), 86400),
        ("monthly", datetime(2026, 2, 1, 0, 0, 0, tzinfo=UTC), 28 * 86400),
    ],
)
def test_quota_reset_seconds_count_to_the_end_of_the_period(
    period: str, now: datetime, seconds: int
) -> None:
    assert quota_reset_seconds(period, now.timestamp()) == seconds
