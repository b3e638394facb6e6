"""The playground: chat with a model through the gateway, like any client.

The browser never holds a tenant key. The console issues a short-lived key per user and
tenant (``tenants.services.issue_api_key``, stored hashed as always) and keeps its
plaintext only in the user's server-side session; this view relays the streamed chat from
``/v1/chat/completions`` and adds time to first token, tokens and cost for each reply.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from console import queries
from console.templatetags.console import money_text
from deployments.access import adapters_for_tenant, models_for_tenant
from deployments.choices import AdapterStatus, Task
from deployments.models import Adapter
from tenants import services
from tenants.access import tenants_of
from tenants.models import ApiKey, Tenant

SESSION_KEY = "playground_keys"
KEY_LIFETIME = timedelta(hours=12)
MAX_TOKENS = 1024
FRESH_KEY_RETRIES = 25  # × 0.2 s


def billable_tenants(user: Any) -> list[Tenant]:
    """The tenants a chat may bill: the user's active ones; for platform admins Tollgate's
    own ``platform`` tenant first, kept out of customers' showback."""
    tenants = list(tenants_of(user).filter(status="active", internal=False).order_by("name"))
    return [services.platform_tenant(), *tenants] if user.is_staff else tenants


@login_required
def playground(request: HttpRequest) -> HttpResponse:
    # Never a silent default: until the user names the tenant to bill, the page asks.
    tenants = billable_tenants(request.user)
    tenant = next((t for t in tenants if t.slug == request.GET.get("tenant")), None)
    models = (
        list(models_for_tenant(tenant).filter(task=Task.GENERATE).order_by("served_name"))
        if tenant
        else []
    )
    adapters = _adapters(tenant) if tenant else []
    for model in models:  # each base with the adapters of it the tenant may call
        model.usable_adapters = [a for a in adapters if a.base_id == model.pk]
    return render(
        request,
        "console/playground/page.html",
        {
            "nav": "playground",
            "tenants": tenants,
            "tenant": tenant,
            "chosen": request.GET.get("tenant", ""),
            "models": models,
            "selected": request.GET.get("model", ""),
            "max_tokens": MAX_TOKENS,
        },
    )


def _adapters(tenant: Tenant) -> list[Adapter]:
    """The adapters the tenant may call whose files passed their check."""
    ready = adapters_for_tenant(tenant).filter(status=AdapterStatus.READY)
    return list(ready.order_by("served_name"))


def _priced(tenant: Tenant, name: str) -> Any:
    """The price a chat with ``name`` (a model or an adapter) is shown at: what billing uses."""
    model = models_for_tenant(tenant).filter(served_name=name).first()
    if model is not None:
        return queries.current_price(model, tenant.currency)
    adapter = adapters_for_tenant(tenant).select_related("base").filter(served_name=name).first()
    if adapter is not None:
        return queries.current_price(adapter.base, tenant.currency, adapter=adapter)
    return None


def playground_key(request: HttpRequest, tenant: Tenant) -> tuple[str, bool]:
    """This user's playground key for the tenant, from the session or fresh (True)."""
    held = request.session.get(SESSION_KEY, {})
    entry = held.get(str(tenant.pk))
    if entry and ApiKey.objects.usable().filter(pk=entry["id"], tenant=tenant).exists():
        return entry["key"], False
    issued = services.issue_api_key(
        request.user,
        tenant,
        name=f"playground ({request.user.get_username()})",
        expires_at=timezone.now() + KEY_LIFETIME,
    )
    held[str(tenant.pk)] = {"id": issued.key.pk, "key": issued.plaintext}
    request.session[SESSION_KEY] = held
    return issued.plaintext, True


def upstream_url(request: HttpRequest) -> str:
    """The gateway: the configured URL, else this very server over loopback."""
    base = (
        settings.TOLLGATE_PLAYGROUND_UPSTREAM
        or f"http://127.0.0.1:{request.META.get('SERVER_PORT', '8000')}"
    )
    return base.rstrip("/") + "/v1/chat/completions"


@login_required
@require_POST
def playground_chat(request: HttpRequest) -> HttpResponse:
    try:
        body = json.loads(request.body)
        slug, model_name, messages = body["tenant"], body["model"], body["messages"]
        max_tokens = max(1, min(int(body.get("max_tokens") or MAX_TOKENS), 8192))
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "Send tenant, model and messages."}, status=400)
    tenant = get_object_or_404(tenants_of(request.user).filter(status="active"), slug=slug)
    if not isinstance(messages, list) or not messages:
        return JsonResponse({"error": "messages must be a non-empty list."}, status=400)
    price = _priced(tenant, model_name)
    key, fresh = playground_key(request, tenant)
    payload = {
        "model": model_name,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = StreamingHttpResponse(
        relay(upstream_url(request), key, payload, price, tenant.currency, fresh),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"
    return response


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


async def relay(
    url: str, key: str, payload: dict[str, Any], price: Any, currency: str, fresh: bool = False
) -> AsyncIterator[bytes]:
    """The gateway's SSE stream turned into delta / stats / error events for the page."""
    started, state = time.monotonic(), {"ttft": None, "usage": None, "request_id": ""}
    # A key issued a moment ago reaches the gateway's cache through pub/sub: give it a few
    # seconds before taking "invalid key" for an answer.
    attempts = FRESH_KEY_RETRIES if fresh else 1
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5)) as client:
            for attempt in range(attempts):
                started = time.monotonic()  # time to first token of the attempt that answered
                async with client.stream(
                    "POST", url, json=payload, headers={"Authorization": f"Bearer {key}"}
                ) as answer:
                    state["request_id"] = answer.headers.get("x-request-id", "")
                    if answer.status_code == 401 and attempt + 1 < attempts:
                        await asyncio.sleep(0.2)
                        continue
                    if answer.status_code != 200:
                        yield sse(
                            "error",
                            {
                                "status": answer.status_code,
                                "message": _error_message(await answer.aread()),
                            },
                        )
                        return
                    async for frame in _deltas(answer, started, state):
                        yield frame
                    break
    except httpx.HTTPError as exc:
        yield sse(
            "error",
            {
                "status": 502,
                "message": f"The gateway could not be reached: {exc.__class__.__name__}",
            },
        )
        return
    yield sse(
        "stats",
        _stats(
            state["usage"],
            state["ttft"],
            time.monotonic() - started,
            price,
            currency,
            state["request_id"],
        ),
    )


async def _deltas(
    answer: httpx.Response, started: float, state: dict[str, Any]
) -> AsyncIterator[bytes]:
    async for line in answer.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        state["usage"] = chunk.get("usage") or state["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = (
                delta.get("content")
                or delta.get("reasoning_content")
                or delta.get("reasoning")
                or ""
            )
            if text:
                if state["ttft"] is None:
                    state["ttft"] = time.monotonic() - started
                yield sse("delta", {"text": text})


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:300]


def _stats(
    usage: dict | None, ttft: float | None, total: float, price: Any, currency: str, request_id: str
) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = (
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
    )
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    cost: Decimal | None = queries.cost_of(price, prompt, cached, completion)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "ttft_ms": round(ttft * 1000) if ttft is not None else None,
        "total_ms": round(total * 1000),
        "tokens_per_s": round(completion / (total - ttft), 1)
        if ttft is not None and total > ttft and completion
        else None,
        "cost": money_text(cost) if cost is not None else None,
        "currency": currency,
        "request_id": request_id,
    }
