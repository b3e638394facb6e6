"""GET /v1/usage: a tenant key reads its own usage and its tenant's remaining quota."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import orjson
import pytest
import time_machine
from django.test import Client

from core.credentials import INVALID_KEY
from metering import services
from tenants import services as tenant_services
from tests.metering.conftest import drain, emit, record

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
INVALID = orjson.loads(INVALID_KEY)  # exactly the gateway's 401


@pytest.fixture
def issued(alice, tenant_a, public_model, private_model_a):
    tenant_services.update_tenant(None, tenant_a, quota_tokens=100_000, quota_amount=Decimal("5"))
    with time_machine.travel(NOW - timedelta(days=30), tick=False):
        services.set_price(None, public_model, Decimal("1"), Decimal("0.5"), Decimal("2"))
        services.set_price(None, private_model_a, Decimal("3"), None, Decimal("6"))
    mine = tenant_services.issue_api_key(alice, tenant_a, name="mine")
    other = tenant_services.issue_api_key(alice, tenant_a, name="other").key
    with time_machine.travel(NOW, tick=False):
        emit(
            record(tenant_a, public_model, mine.key, at=NOW - timedelta(days=2)),
            record(tenant_a, private_model_a, mine.key, at=NOW - timedelta(hours=1)),
            record(tenant_a, public_model, other, at=NOW - timedelta(hours=3)),
            record(tenant_a, public_model, mine.key, at=NOW - timedelta(days=40)),  # October
        )
        drain()
    return mine


def get(key: str | None, **params):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"} if key else {}
    return Client().get("/v1/usage", params, **headers)


@time_machine.travel(NOW, tick=False)
def test_a_key_reads_its_usage_and_the_tenant_quota_for_the_current_period(issued) -> None:
    response = get(issued.plaintext)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "usage" and body["tenant"] == "acme"
    assert body["key"] == {"name": "mine", "prefix": issued.key.prefix}
    assert body["start"] == "2026-11-01T00:00:00+00:00"
    # Per event: 800 + 200 x 0.5 + 300 x 2 = 1500 per 1M at USD 1/0.5/2; 2400+600+1800=4800 at 3/3/6
    assert body["key_usage"] == {
        "requests": 2,
        "prompt_tokens": 2000,
        "cached_tokens": 400,
        "completion_tokens": 600,
        "total_tokens": 2600,
        "cost": "0.006300000",
    }
    assert body["tenant_usage"]["requests"] == 3 and body["tenant_usage"]["cost"] == "0.007800000"
    quota = body["quota"]
    assert quota["tokens"] == 100_000 and quota["tokens_used"] == 3900
    assert quota["tokens_remaining"] == 96_100
    assert quota["amount"] == "5.0000" and quota["amount_remaining"] == "4.992200000"
    assert quota["period_id"] == "2026-11" and body["currency"] == "USD"


@time_machine.travel(NOW, tick=False)
def test_group_by_model_and_day_and_a_custom_range(issued) -> None:
    by_model = get(issued.plaintext, group_by="model").json()["data"]
    assert [(d["model"], d["requests"]) for d in by_model] == [
        ("acme-secret-70b", 1),
        ("qwen3-8b", 1),
    ]
    by_day = get(issued.plaintext, group_by="day", start="2026-10-01", end="2026-12-01").json()
    assert [d["day"] for d in by_day["data"]] == ["2026-10-11", "2026-11-18", "2026-11-20"]
    assert by_day["key_usage"]["requests"] == 3


@pytest.mark.parametrize(
    "params",
    [{"group_by": "hour"}, {"start": "soon"}, {"start": "2026-11-05", "end": "2026-11-01"}],
)
@time_machine.travel(NOW, tick=False)
def test_bad_parameters_answer_400(issued, params) -> None:
    response = get(issued.plaintext, **params)
    assert (
        response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    )


@time_machine.travel(NOW, tick=False)
def test_every_authentication_failure_gives_the_same_401(issued, alice) -> None:
    wrong_secret = issued.plaintext[:-4] + "AAAA"
    admin_token = tenant_services.issue_admin_token(alice, name="t").plaintext
    revoked = tenant_services.issue_api_key(alice, issued.key.tenant, name="gone")
    tenant_services.revoke_api_key(alice, revoked.key)
    for key in (
        None,
        "nonsense",
        wrong_secret,
        admin_token,
        revoked.plaintext,
        "tg-zzzzzzzz-" + "A" * 40,
    ):
        response = get(key)
        assert (response.status_code, response.json()) == (401, INVALID), key
