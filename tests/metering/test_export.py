"""Showback export: CSV totals equal the events for every filter; who may export what."""

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from itertools import product

import pytest
import time_machine
from django.db.models import Q, Sum

from metering import export, services
from metering.models import UsageEvent
from tests.metering.conftest import drain, emit, record

T0 = datetime(2026, 11, 3, 8, 0, tzinfo=UTC)


@pytest.fixture
def usage(tenant_a, tenant_b, key_a, key_a2, key_b, public_model, private_model_a):
    """Events over three days, two tenants, three keys, two models and a price change."""
    with time_machine.travel(T0 - timedelta(days=1), tick=False):
        services.set_price(None, public_model, Decimal("0.20"), Decimal("0.10"), Decimal("0.60"))
        services.set_price(None, private_model_a, Decimal("1.5"), None, Decimal("2.25"))
    with time_machine.travel(T0 + timedelta(days=1, hours=5), tick=False):
        services.set_price(None, public_model, Decimal("0.30"), Decimal("0.15"), Decimal("0.90"))
    records = []
    for i in range(60):
        key = [key_a, key_a2, key_b][i % 3]
        model = private_model_a if key.tenant == tenant_a and i % 4 == 0 else public_model
        records.append(
            record(
                key.tenant,
                model,
                key,
                at=T0 + timedelta(minutes=71 * i),
                prompt_tokens=1000 + 37 * i,
                cached_tokens=11 * i,
                completion_tokens=77 + 5 * i,
                status="error" if i % 10 == 0 else "ok",
                # Now and then no engine could count the prompt: the gateway estimated it.
                prompt_estimated=i % 7 == 0,
            )
        )
    emit(*records)
    drain()
    assert UsageEvent.objects.count() == 60
    return records


def parse(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def csv_text(q: export.ExportQuery) -> str:
    return "".join(export.csv_lines(q))


def event_sums(where: Q) -> dict:
    events = UsageEvent.objects.filter(where)
    return {
        "requests": events.count(),
        **events.aggregate(
            prompt=Sum("prompt_tokens"),
            cached=Sum("cached_tokens"),
            completion=Sum("completion_tokens"),
            cost=Sum("cost"),
        ),
        "estimated": events.filter(prompt_estimated=True).aggregate(n=Sum("prompt_tokens"))["n"]
        or 0,
    }


FILTERS = {
    "all": ({}, Q()),
    "tenant": ({"tenant": "acme"}, Q(tenant__slug="acme")),
    "model": ({"model": "qwen3-8b"}, Q(model__served_name="qwen3-8b")),
    "tenant+model": (
        {"tenant": "acme", "model": "acme-secret-70b"},
        Q(tenant__slug="acme", model__served_name="acme-secret-70b"),
    ),
}
RANGES = {
    "month": (
        {"period": "2026-11"},
        Q(occurred_at__gte=T0.replace(day=1), occurred_at__lt=datetime(2026, 12, 1, tzinfo=UTC)),
    ),
    "day": (
        {"period": "2026-11-04"},
        Q(
            occurred_at__gte=datetime(2026, 11, 4, tzinfo=UTC),
            occurred_at__lt=datetime(2026, 11, 5, tzinfo=UTC),
        ),
    ),
    "hours": (
        {"start": "2026-11-03T13:00:00Z", "end": "2026-11-04T02:00:00Z"},
        Q(
            occurred_at__gte=datetime(2026, 11, 3, 13, tzinfo=UTC),
            occurred_at__lt=datetime(2026, 11, 4, 2, tzinfo=UTC),
        ),
    ),
}


@pytest.mark.parametrize(
    ("filt", "rng", "granularity"), list(product(FILTERS, RANGES, export.GRANULARITIES))
)
def test_showback_totals_equal_the_sum_of_events(usage, filt, rng, granularity) -> None:
    params = {**FILTERS[filt][0], **RANGES[rng][0], "granularity": granularity}
    lines = parse(csv_text(export.parse_query(params, None)))
    expected = event_sums(FILTERS[filt][1] & RANGES[rng][1])

    assert expected["requests"] > 0
    assert sum(int(r["requests"]) for r in lines) == expected["requests"]
    assert sum(int(r["prompt_tokens"]) for r in lines) == expected["prompt"]
    assert sum(int(r["cached_tokens"]) for r in lines) == expected["cached"]
    assert sum(int(r["completion_tokens"]) for r in lines) == expected["completion"]
    assert sum(Decimal(r["cost"]) for r in lines) == expected["cost"]
    assert sum(int(r["estimated_prompt_tokens"]) for r in lines) == expected["estimated"]


def test_key_filter_and_columns(usage, key_a) -> None:
    q = export.parse_query({"period": "2026-11", "key": key_a.prefix, "granularity": "month"}, None)
    lines = parse(csv_text(q))
    assert list(lines[0]) == export.SHOWBACK_COLUMNS
    assert {r["key_prefix"] for r in lines} == {key_a.prefix}
    assert {r["key_name"] for r in lines} == {"acme-prod"}
    assert sum(int(r["requests"]) for r in lines) == 20
    assert lines[0]["period_start"] == "2026-11-01T00:00:00Z"
    assert lines[0]["period_end"] == "2026-12-01T00:00:00Z"


def test_a_price_change_gives_separate_lines_with_their_unit_prices(usage) -> None:
    q = export.parse_query({"period": "2026-11", "tenant": "bravo", "granularity": "month"}, None)
    lines = parse(csv_text(q))
    assert sorted((r["input_per_mtok"], r["output_per_mtok"]) for r in lines) == [
        ("0.200000", "0.600000"),
        ("0.300000", "0.900000"),
    ]
    assert all("e" not in r["cost"].lower() for r in lines)  # plain decimals


@pytest.mark.parametrize("granularity", export.GRANULARITIES)
def test_focus_totals_equal_the_showback_totals(usage, granularity) -> None:
    params = {"period": "2026-11", "granularity": granularity}
    showback = parse(csv_text(export.parse_query(params, None)))
    focus = parse(csv_text(export.parse_query({**params, "format": "focus"}, None)))

    assert list(focus[0]) == export.FOCUS_COLUMNS
    assert sum(Decimal(r["BilledCost"]) for r in focus) == sum(Decimal(r["cost"]) for r in showback)
    tokens = sum(int(r["ConsumedQuantity"]) for r in focus)
    assert tokens == sum(int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in showback)
    assert {r["ChargeCategory"] for r in focus} == {"Usage"}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"granularity": "week"}, "granularity"),
        ({"format": "xlsx"}, "format"),
        ({"period": "2026-13"}, "period"),
        ({"start": "yesterday", "end": "2026-11-02"}, "start"),
        ({"start": "2026-11-05", "end": "2026-11-02"}, "end"),
    ],
)
def test_invalid_parameters_are_refused_with_a_message(params, field) -> None:
    with pytest.raises(Exception) as exc:
        export.parse_query(params, None)
    assert field in exc.value.message_dict


# --- The admin API endpoint ----------------------------------------------------------------

URL = "/api/v1/usage/export.csv"


def body(response) -> list[dict[str, str]]:
    assert response.streaming
    return parse(b"".join(response.streaming_content).decode())


def test_tenant_admin_exports_only_their_tenant(usage, alice, client_for) -> None:
    client = client_for(alice)
    response = client.get(URL, {"period": "2026-11"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert {r["tenant"] for r in body(response)} == {"acme"}
    assert client.get(URL, {"period": "2026-11", "tenant": "bravo"}).status_code == 404
    assert client.get(URL, {"period": "2026-11", "tenant": "nope"}).status_code == 404


def test_other_tenant_admin_sees_nothing_of_tenant_a(usage, carol, client_for) -> None:
    client = client_for(carol)
    assert {r["tenant"] for r in body(client.get(URL, {"period": "2026-11"}))} == {"bravo"}
    assert client.get(URL, {"period": "2026-11", "tenant": "acme"}).status_code == 404


def test_members_may_not_export(usage, bob, client_for) -> None:
    client = client_for(bob)
    assert client.get(URL, {"period": "2026-11"}).status_code == 403
    assert client.get(URL, {"period": "2026-11", "tenant": "acme"}).status_code == 403


def test_platform_admin_exports_everything_in_both_formats(usage, root, client_for) -> None:
    client = client_for(root)
    lines = body(client.get(URL, {"period": "2026-11", "granularity": "month"}))
    assert {r["tenant"] for r in lines} == {"acme", "bravo"}
    assert sum(int(r["requests"]) for r in lines) == 60
    focus = body(client.get(URL, {"period": "2026-11", "format": "focus"}))
    assert sum(Decimal(r["BilledCost"]) for r in focus) == sum(Decimal(r["cost"]) for r in lines)


def test_bad_parameters_answer_400_with_a_message(root, client_for) -> None:
    response = client_for(root).get(URL, {"granularity": "fortnight"})
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert [e["field"] for e in response.json()["errors"]] == ["granularity"]


def test_anonymous_is_refused(client) -> None:
    assert client.get(URL).status_code in (401, 403)
