"""Abuse from tenants and clients: forged keys, key leaks, another tenant's objects,
privilege escalation, redirect fields, Host and path tricks, oversized requests, an engine
that never ends its SSE line, and the production settings check."""

from __future__ import annotations

import asyncio
import http.server
import os
import random
import string
import subprocess
import sys
import threading
from decimal import Decimal
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from deployments import services as deployment_services
from deployments.choices import Visibility
from metering.models import UsageEvent
from tenants import services as tenant_services
from tenants.choices import Role
from tenants.models import ApiKey, AuditLog, Membership, Tenant
from tests.faults.conftest import (
    ROOT,
    Gateway,
    build_world,
    chat_body,
    free_port,
    make_model,
    route,
    start_engine,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]


def api_client(user: object) -> tuple[APIClient, str]:
    issued = tenant_services.issue_admin_token(user, name="faults")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.plaintext}")
    return client, issued.plaintext


def user(
    name: str, tenant: Tenant | None = None, role: str = Role.ADMIN, staff: bool = False
) -> object:
    u = get_user_model().objects.create_user(
        name, f"{name}@example.test", "pw-" + name * 4, is_staff=staff
    )
    if tenant is not None:
        tenant_services.add_member(None, tenant, u, role)
    return u


# --- Forged keys -------------------------------------------------------------------------


def fuzzed_credentials(real: str, n: int, seed: int = 10) -> list[dict[str, str]]:
    """Header sets that must all be refused the same way: SQL and shell injection, near
    misses of a real key, random printable strings, and every way of presenting them."""
    rnd = random.Random(seed)
    prefix, secret = real.rsplit("-", 1)
    printable = string.ascii_letters + string.digits + string.punctuation + " "
    near = [
        "' OR '1'='1",
        "' OR 1=1 --",
        '" OR ""="',
        "1; DROP TABLE tenants_apikey; --",
        "$(id)",
        "`id`",
        "../../etc/passwd",
        "%00",
        "null",
        "None",
        "undefined",
        "*",
        "tg-*",
        "tg-",
        "-",
        "tg--",
        real[:-1],
        real + "x",
        real[:-1] + ("A" if real[-1] != "A" else "B"),
        real.upper(),
        real.lower(),
        prefix + "-",
        prefix + "-" + secret[::-1],
        "tg-" + prefix[3:] + "-" + "a" * len(secret),
        real + " " + real,
        real * 2,
        "tg-" + "x" * 300,
        prefix,
        secret,
        real.replace("tg-", "sk-"),
    ]
    tokens = near + [
        "".join(rnd.choice(printable) for _ in range(rnd.randint(1, 120))).strip() or "x"
        for _ in range(max(n // 8 - len(near), 0))
    ]
    forms = [
        lambda t: {"Authorization": f"Bearer {t}"},
        lambda t: {"Authorization": f"bearer {t}"},
        lambda t: {"Authorization": f"Bearer  {t}"},
        lambda t: {"Authorization": t},
        lambda t: {"Authorization": f"Basic {t}"},
        lambda t: {"Authorization": f"Token {t}"},
        lambda t: {"api-key": t},
        lambda t: {"Authorization": f"Bearer {t}", "api-key": t},
    ]
    headers = [form(t) for t in tokens for form in forms]
    headers += [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer "},
        {"api-key": ""},
        {"Authorization": f"Basic {real}"},
        {"X-Api-Key": real},
        {"Authorization": f"Token {real}"},
    ]
    return (
        headers[:n]
        if len(headers) >= n
        else headers
        + [{"Authorization": f"Bearer {rnd.random()}"} for _ in range(n - len(headers))]
    )


async def send_all(
    url: str, requests: list[tuple[str, str, dict[str, str], bytes | None]], concurrency: int = 32
) -> list[tuple[int, bytes]]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one(
            method: str, path: str, headers: dict[str, str], body: bytes | None
        ) -> tuple[int, bytes]:
            async with sem, session.request(method, url + path, headers=headers, data=body) as r:
                return r.status, await r.read()

        return await asyncio.gather(*(one(*r) for r in requests))


def test_forged_keys_in_every_header_form_are_401_with_one_identical_body(
    procs, gateway_env
) -> None:
    engine = start_engine(procs, ("sim-chat",), "--sim-ttft-ms", "1", "--sim-decode-tps", "0")
    world = build_world(engine.port)
    # Keys that once were good: revoked, expired, of a suspended tenant.
    revoked = tenant_services.issue_api_key(None, world.tenant_a, name="old")
    tenant_services.revoke_api_key(None, revoked.key)
    from django.utils import timezone

    expired = tenant_services.issue_api_key(
        None, world.tenant_a, name="exp", expires_at=timezone.now() + timezone.timedelta(seconds=1)
    )
    suspended = Tenant.objects.create(name="Gone", slug="gone", status="suspended")
    of_suspended = tenant_services.issue_api_key(None, suspended, name="s")
    import time

    time.sleep(1.1)
    gw = Gateway(procs, gateway_env()).start().wait_ready(world.key_a)
    body = orjson.dumps(chat_body())
    creds = fuzzed_credentials(world.key_a, 10_000)
    for dead in (revoked.plaintext, expired.plaintext, of_suspended.plaintext):
        creds += [{"Authorization": f"Bearer {dead}"}, {"api-key": dead}]
    paths = [
        ("POST", "/v1/chat/completions", body),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/sim-chat", None),
        ("POST", "/v1/embeddings", body),
        ("POST", "/v1/completions", body),
    ]
    requests = [
        (m, p, {**h, "Content-Type": "application/json"}, b)
        for i, h in enumerate(creds)
        for m, p, b in [paths[i % len(paths)]]
    ]
    # The Django-served /v1 endpoints too (usage, files, batches), on a sample.
    requests += [
        ("GET", p, h, None) for h in creds[:300] for p in ("/v1/usage", "/v1/files", "/v1/batches")
    ]

    answers = asyncio.run(send_all(gw.url, requests))

    assert len(answers) >= 10_000
    statuses = {s for s, _ in answers}
    assert statuses == {401}, {s: sum(1 for x, _ in answers if x == s) for s in statuses}
    bodies = {b for _, b in answers}
    assert len(bodies) == 1, bodies
    assert orjson.loads(bodies.pop())["error"]["code"] == "invalid_api_key"
    # And the real key still works: the refusals were about the credentials, not an outage.
    ok = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json=chat_body(),
        headers={"Authorization": f"Bearer {world.key_a}"},
    )
    assert ok.status_code == 200


# --- Key plaintext leaks -----------------------------------------------------------------


def test_a_keys_plaintext_appears_only_in_its_creation_response(procs, gateway_env, caplog) -> None:
    """A session of everything a tenant and an admin do with a key; then the key's secret is
    searched in every log line (gateway and Django, at DEBUG), every audit and usage row,
    every Redis value under the test's prefix, and every response but the creation one."""
    import logging

    caplog.set_level(logging.DEBUG)
    engine = start_engine(procs, ("sim-chat",), "--sim-ttft-ms", "1", "--sim-decode-tps", "0")
    world = build_world(engine.port)
    alice = user("alice", world.tenant_a)
    api, _ = api_client(alice)
    created = api.post(
        "/api/v1/keys/",
        {"tenant": "acme", "name": "leaky", "requests_per_minute": 3},
        format="json",
    )
    assert created.status_code == 201, created.content
    plaintext = created.json()["key"]
    secret = plaintext.rsplit("-", 1)[1]
    gw = Gateway(procs, gateway_env(TOLLGATE_LOG_LEVEL="DEBUG")).start().wait_ready(plaintext)
    seen: list[bytes] = []

    def record(r: httpx.Response) -> httpx.Response:
        seen.append(
            r.content + b"\n" + "\n".join(f"{k}: {v}" for k, v in r.headers.items()).encode()
        )
        return r

    auth = {"Authorization": f"Bearer {plaintext}"}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        record(http.post("/v1/chat/completions", json=chat_body(), headers=auth))
        record(http.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth))
        record(http.post("/v1/chat/completions", json=chat_body(model="nope"), headers=auth))
        record(http.post("/v1/chat/completions", content=b"{not json", headers=auth))
        for _ in range(3):
            record(http.post("/v1/chat/completions", json=chat_body(), headers=auth))  # 429s
        record(http.get("/v1/usage", headers=auth))
        record(http.get(f"/v1/models?api_key={plaintext}", headers={"api-key": plaintext}))
        record(http.post("/v1/chat/completions", json=chat_body(api_key=plaintext), headers=auth))
        key_id = created.json()["id"]
        for path in (
            "/api/v1/keys/",
            f"/api/v1/keys/{key_id}/",
            "/api/v1/audit/",
            "/api/v1/usage/",
        ):
            seen.append(api.get(path).content)
        seen.append(api.post(f"/api/v1/keys/{key_id}/revoke/").content)
        # The admin API refuses inference keys; its refusal must not echo the key.
        seen.append(
            APIClient().get("/api/v1/keys/", HTTP_AUTHORIZATION=f"Bearer {plaintext}").content
        )
        import time

        deadline = time.monotonic() + 10
        while (
            http.get("/v1/models", headers=auth).status_code != 401 and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        record(http.post("/v1/chat/completions", json=chat_body(), headers=auth))
    assert seen[-1].startswith(b'{"error"') and b"invalid_api_key" in seen[-1]
    from tenants.models import ApiKey as Key

    gw.proc.terminate()
    gw.proc.wait(timeout=15)

    places = {
        "gateway log": gw.log(),
        "django log": "\n".join(r.getMessage() + str(r.__dict__) for r in caplog.records),
        "responses": b"\n".join(seen).decode("latin-1"),
        "audit rows": "\n".join(map(str, AuditLog.objects.values())),
        "usage rows": "\n".join(map(str, UsageEvent.objects.values())),
        "key rows": "\n".join(map(str, Key.objects.values())),
        "redis": _redis_dump(),
    }
    assert len(places["gateway log"]) > 200  # the gateway did log at DEBUG
    leaks = [where for where, text in places.items() if secret in text]
    assert not leaks, f"the key's secret appears in: {leaks}"


def _redis_dump() -> str:
    from django.conf import settings

    from core.redis import get_redis

    r, out = get_redis(), []
    for name in r.scan_iter(f"{settings.TOLLGATE_REDIS_PREFIX}:*"):
        kind = r.type(name).decode()
        value = {
            "string": r.get,
            "hash": r.hgetall,
            "zset": lambda n: r.zrange(n, 0, -1),
            "set": r.smembers,
            "list": lambda n: r.lrange(n, 0, -1),
            "stream": lambda n: r.xrange(n),
        }[kind](name)
        out.append(f"{name!r} {value!r}")
    return "\n".join(out)


# --- Another tenant's objects ------------------------------------------------------------


def _without_instance(response: Any) -> Any:
    return {k: v for k, v in response.json().items() if k != "instance"}


def test_tenant_a_key_and_admin_reach_nothing_of_tenant_b(procs, gateway_env) -> None:
    """The key surfaces (/v1) and the admin API objects a tenant admin might guess. The
    admin API's full route × method table lives in tests/api/test_isolation.py."""
    engine = start_engine(
        procs, ("sim-chat", "bravo-private"), "--sim-ttft-ms", "1", "--sim-decode-tps", "0"
    )
    world = build_world(engine.port)
    private_b = make_model("bravo-private", visibility=Visibility.PRIVATE)
    deployment_services.grant_model(None, private_b, world.tenant_b)
    route(private_b, world.node, engine.port)
    alice, carol = user("alice", world.tenant_a), user("carol", world.tenant_b)
    gw = Gateway(procs, gateway_env()).start().wait_ready(world.key_b)
    a, b = {"Authorization": f"Bearer {world.key_a}"}, {"Authorization": f"Bearer {world.key_b}"}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        b_answer = http.post(
            "/v1/chat/completions", json=chat_body(model="bravo-private"), headers=b
        )
        assert b_answer.status_code == 200
        b_request = b_answer.headers["x-request-id"]
        assert [m["id"] for m in http.get("/v1/models", headers=a).json()["data"]] == ["sim-chat"]
        assert "bravo-private" in [
            m["id"] for m in http.get("/v1/models", headers=b).json()["data"]
        ]
        hidden = http.get("/v1/models/bravo-private", headers=a)
        unknown = http.get("/v1/models/no-such-model", headers=a)
        assert hidden.status_code == unknown.status_code == 404
        assert (
            hidden.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"
        )
        for endpoint in ("/v1/chat/completions", "/v1/completions"):
            r = http.post(endpoint, json=chat_body(model="bravo-private"), headers=a)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        b_file = http.post(
            "/v1/files",
            headers=b,
            files={
                "file": (
                    "b.jsonl",
                    b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",'
                    b' "body": {"model": "bravo-private", "messages": []}}\n',
                )
            },
            data={"purpose": "batch"},
        )
        assert b_file.status_code == 200, b_file.text
        file_id = b_file.json()["id"]
        for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
            assert http.get(path, headers=a).status_code == 404
        assert http.delete(f"/v1/files/{file_id}", headers=a).status_code == 404
        assert file_id not in http.get("/v1/files", headers=a).text
        usage = http.get("/v1/usage", headers=a).json()
        assert usage["tenant"] == "acme" and usage["tenant_usage"]["requests"] == 0
    from metering import ingest

    ingest.drain("faults", seconds=20)
    assert UsageEvent.objects.filter(request_id=b_request).exists()
    api, _ = api_client(alice)
    key_b = ApiKey.objects.get(tenant=world.tenant_b)
    membership_b = Membership.objects.get(user=carol)
    audit_b = AuditLog.objects.filter(tenant=world.tenant_b).first()
    # (tenant B's object, an object that does not exist): the answers must be the same.
    targets = [
        (f"/api/v1/tenants/{world.tenant_b.slug}/", "/api/v1/tenants/no-such/"),
        (f"/api/v1/keys/{key_b.pk}/", "/api/v1/keys/999999/"),
        (f"/api/v1/members/{membership_b.pk}/", "/api/v1/members/999999/"),
        (f"/api/v1/usage/{b_request}/", "/api/v1/usage/req_000000000000000000000000/"),
        (f"/api/v1/models/{private_b.served_name}/", "/api/v1/models/no-such-model/"),
        (f"/api/v1/users/{carol.username}/", "/api/v1/users/no-such-user/"),
    ]
    if audit_b is not None:
        targets.append((f"/api/v1/audit/{audit_b.pk}/", "/api/v1/audit/999999/"))
    for path, nowhere in targets:
        # /users/ is for platform admins only: 403 for any id, existing or not.
        expected = 403 if path.startswith("/api/v1/users/") else 404
        assert api.get(path).status_code == api.get(nowhere).status_code == expected, path
        for method in ("patch", "delete"):
            answer = getattr(api, method)(path, {}, format="json")
            missing = getattr(api, method)(nowhere, {}, format="json")
            assert answer.status_code == missing.status_code in (403, 404, 405), (
                method,
                path,
                answer.content[:200],
            )
            # Problems name the path asked for (``instance``); everything else is the same.
            assert _without_instance(answer) == _without_instance(missing) or (
                answer.status_code == 404
            )
    assert api.post(f"/api/v1/keys/{key_b.pk}/revoke/").status_code == 404
    assert api.post(f"/api/v1/tenants/{world.tenant_b.slug}/suspend/").status_code == 404
    export = api.get("/api/v1/usage/export.csv", {"tenant": world.tenant_b.slug})
    assert export.status_code == 404
    assert b_request not in api.get("/api/v1/usage/").content.decode()
    key_b.refresh_from_db()
    assert key_b.revoked_at is None and Tenant.objects.get(slug="bravo").status == "active"


# --- Privilege escalation ----------------------------------------------------------------


def test_non_admins_cannot_raise_their_role_tenant_limits_or_admin_only_fields(
    transactional_db,
) -> None:
    acme = tenant_services.create_tenant(
        None,
        name="Acme",
        slug="acme",
        requests_per_minute=100,
        tokens_per_minute=10_000,
        max_concurrent_requests=4,
        quota_amount=Decimal("10"),
    )
    bravo = tenant_services.create_tenant(None, name="Bravo", slug="bravo")
    alice, bob = user("alice", acme, Role.ADMIN), user("bob", acme, Role.MEMBER)
    before = {
        f: getattr(acme, f)
        for f in (
            "requests_per_minute",
            "tokens_per_minute",
            "max_concurrent_requests",
            "quota_amount",
            "priority",
            "status",
        )
    }
    for who in (alice, bob):
        api, _ = api_client(who)
        me = Membership.objects.get(user=who)
        attempts = [
            ("patch", f"/api/v1/members/{me.pk}/", {"role": "admin", "tenant": "bravo"}),
            (
                "patch",
                "/api/v1/tenants/acme/",
                {
                    "requests_per_minute": 10**6,
                    "tokens_per_minute": 10**9,
                    "max_concurrent_requests": 1000,
                    "quota_amount": "999999",
                    "priority": "P0",
                    "fair_share_weight": 100,
                },
            ),
            ("post", "/api/v1/tenants/acme/activate/", {}),
            ("patch", f"/api/v1/users/{who.username}/", {"is_staff": True, "is_superuser": True}),
            ("post", "/api/v1/members/", {"tenant": "bravo", "user": who.pk, "role": "admin"}),
            (
                "post",
                "/api/v1/models/",
                {
                    "served_name": "mine",
                    "source": "x/y",
                    "params_billions": "1",
                    "context_length": 4096,
                },
            ),
            (
                "post",
                "/api/v1/prices/",
                {"model": "mine", "input_per_mtok": "0", "output_per_mtok": "0"},
            ),
        ]
        for method, path, body in attempts:
            answer = getattr(api, method)(path, body, format="json")
            assert answer.status_code in (400, 403, 404), (
                who.username,
                method,
                path,
                answer.status_code,
                answer.content[:300],
            )
        # A key may be created (by whoever may), but never looser than the tenant.
        answer = api.post(
            "/api/v1/keys/",
            {
                "tenant": "acme",
                "name": f"{who.username}-k",
                "requests_per_minute": 10**6,
                "tokens_per_minute": 10**9,
                "max_concurrent_requests": 1000,
            },
            format="json",
        )
        if answer.status_code == 201:
            key = ApiKey.objects.get(pk=answer.json()["id"])
            assert (key.requests_per_minute or 0) <= 100 and key.tokens_per_minute <= 10_000
            assert key.max_concurrent_requests <= 4
        else:
            assert answer.status_code in (400, 403), answer.content
        # Admin tokens are one's own: naming another user is ignored or refused.
        answer = api.post("/api/v1/tokens/", {"name": "t", "user": 1}, format="json")
        if answer.status_code == 201:
            from tenants.models import AdminToken

            assert AdminToken.objects.get(pk=answer.json()["id"]).user == who
    acme.refresh_from_db()
    assert {f: getattr(acme, f) for f in before} == before
    assert Membership.objects.get(user=bob).role == Role.MEMBER
    assert not Membership.objects.filter(tenant=bravo).exists()
    assert not get_user_model().objects.filter(is_staff=True).exists()
    assert not get_user_model().objects.filter(is_superuser=True).exists()


# --- Redirect fields ---------------------------------------------------------------------


class Canary(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_POST(self) -> None:  # noqa: N802
        Canary.hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0}}')

    do_GET = do_POST

    def log_message(self, *args: object) -> None:
        pass


def test_redirect_fields_in_the_body_are_ignored(procs, gateway_env) -> None:
    engine = start_engine(procs, ("sim-chat",), "--sim-ttft-ms", "1", "--sim-decode-tps", "0")
    world = build_world(engine.port)
    canary = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Canary)
    threading.Thread(target=canary.serve_forever, daemon=True).start()
    internal = f"http://127.0.0.1:{canary.server_address[1]}"
    gw = Gateway(procs, gateway_env()).start().wait_ready(world.key_a)
    Canary.hits = []
    try:
        fields = {
            "api_base": internal,
            "base_url": internal + "/v1",
            "api_key": "x",
            "custom_llm_provider": "openai",
            "extra_headers": {"Host": "169.254.169.254"},
            "headers": {"x": "y"},
            "user_api_key": "x",
            "api_version": "2024-01-01",
        }
        for stream in (False, True):
            r = httpx.post(
                f"{gw.url}/v1/chat/completions",
                json=chat_body(stream=stream, **fields),
                headers={"Authorization": f"Bearer {world.key_a}"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert "chatcmpl" in r.text  # answered by the registered simulator engine
        # Fields no API takes are refused (the engine shield), never followed.
        for field in ("url", "endpoint"):
            r = httpx.post(
                f"{gw.url}/v1/chat/completions",
                json=chat_body(**{field: internal}),
                headers={"Authorization": f"Bearer {world.key_a}"},
                timeout=30,
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == field
        for url in ("http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:5432/", internal):
            r = httpx.post(
                f"{gw.url}/v1/chat/completions",
                json=chat_body(api_base=url, base_url=url),
                headers={"Authorization": f"Bearer {world.key_a}"},
                timeout=30,
            )
            assert r.status_code == 200
    finally:
        canary.shutdown()
    assert Canary.hits == []


# --- Host and path tricks ----------------------------------------------------------------


def test_host_and_path_tricks_are_400_or_the_canonical_decision(procs, gateway_env) -> None:
    engine = start_engine(procs, ("sim-chat",), "--sim-ttft-ms", "1", "--sim-decode-tps", "0")
    world = build_world(engine.port)
    token = "faults-metrics-token-0123456789"
    gw = Gateway(procs, gateway_env(TOLLGATE_METRICS_TOKEN=token)).start().wait_ready(world.key_a)
    body = orjson.dumps(chat_body())
    auth = f"Bearer {world.key_a}"

    def raw(
        method: str, target: str, headers: dict[str, str], payload: bytes = b""
    ) -> tuple[int, bytes]:
        """A request line sent byte for byte (clients normalise paths; attackers do not)."""
        import socket

        lines = [f"{method} {target} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
        lines += [f"Content-Length: {len(payload)}", "Connection: close", "", ""]
        with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as s:
            s.sendall("\r\n".join(lines).encode() + payload)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), rest

    base = {
        "Host": f"127.0.0.1:{gw.port}",
        "Authorization": auth,
        "Content-Type": "application/json",
    }
    assert raw("POST", "/v1/chat/completions", base, body)[0] == 200
    for host in (
        "evil.example",
        "evil.example:80",
        "127.0.0.1.evil.example",
        "localhost@evil.example",
        "",
    ):
        status, _ = raw("POST", "/v1/chat/completions", {**base, "Host": host}, body)
        assert status == 400, (host, status)
        status, _ = raw("GET", "/api/v1/tenants/", {**base, "Host": host})
        assert status == 400, (host, status)
    # X-Forwarded-Host is not trusted: the decision is the Host header's.
    for host, expected in ((f"127.0.0.1:{gw.port}", 200), ("evil.example", 400)):
        status, _ = raw(
            "POST",
            "/v1/chat/completions",
            {
                **base,
                "Host": host,
                "X-Forwarded-Host": "evil.example" if expected == 200 else f"127.0.0.1:{gw.port}",
            },
            body,
        )
        assert status == expected, (host, status)
    # Path tricks: refused, or decided exactly as the canonical path would be.
    canonical_metrics = raw("GET", "/metrics", {**base})[0]
    assert canonical_metrics == 404  # no token, no metrics
    for target in (
        "//metrics",
        "/%6detrics",
        "/v1/../metrics",
        "/./metrics",
        "/metrics/",
        "/METRICS",
        "/metrics%00",
        "/v1/models/..%2f..%2fmetrics",
    ):
        status, payload = raw("GET", target, base)
        assert status in (400, 404), (target, status)
        assert b"# HELP" not in payload and b"tollgate_" not in payload
    for target in (
        "//v1/chat/completions",
        "/v1//chat/completions",
        "/v1/chat/completions/",
        "/v1/chat/%63ompletions",
        "/v1/./chat/completions",
        "/v1/chat/completions%2f",
        "/V1/chat/completions",
    ):
        status, payload = raw("POST", target, {**base, "Authorization": "Bearer nope"}, body)
        assert status in (400, 401, 404, 405), (target, status)  # never served without a key
        assert b"chatcmpl" not in payload
    for target in (
        "//api/v1/tenants/",
        "/api/v1/./tenants/",
        "/api//v1/tenants/",
        "/%61pi/v1/tenants/",
    ):
        status, payload = raw("GET", target, {"Host": base["Host"]})
        assert status in (400, 401, 403, 404), (target, status)
        assert b"acme" not in payload


# --- Oversized and endless ---------------------------------------------------------------


ENDLESS_ENGINE = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = b'{"object": "list", "data": [{"id": "endless"}]}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        try:
            self.wfile.write(b"data: "
                b"{\"id\": \"x\", \"choices\": [{\"index\": 0, \"delta\": {\"content\": \"")
            chunk = b"A" * 65536
            for _ in range(4096):  # 256 MiB on one line, never a newline
                self.wfile.write(chunk)
        except OSError:
            pass
    def log_message(self, *a): pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_oversized_requests_are_clear_4xx_and_an_endless_sse_line_is_cut_off(
    procs, gateway_env
) -> None:
    engine = start_engine(procs, ("sim-chat",), "--sim-ttft-ms", "1", "--sim-decode-tps", "0")
    world = build_world(engine.port)
    endless_port = free_port()
    procs.spawn("endless", [sys.executable, "-c", ENDLESS_ENGINE, str(endless_port)])
    endless = make_model("endless")
    route(endless, world.node, endless_port)
    env = gateway_env(
        TOLLGATE_MAX_BODY_BYTES=str(1 << 20), TOLLGATE_MAX_SSE_FRAME_BYTES=str(1 << 20)
    )
    gw = Gateway(procs, env).start().wait_ready(world.key_a)
    auth = {"Authorization": f"Bearer {world.key_a}"}
    with httpx.Client(base_url=gw.url, timeout=60, headers=auth) as http:
        big = {"model": "sim-chat", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        r = http.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json=chat_body(max_tokens=10**9))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = http.post("/v1/chat/completions", json=chat_body(max_tokens=4097))
        assert r.status_code == 400 and "4096" in r.json()["error"]["message"]
        for n in (10**6, 9, -1, 0, "8", 1.5):
            r = http.post("/v1/chat/completions", json=chat_body(n=n))
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", (n, r.text)
        r = http.post("/v1/chat/completions", json=chat_body(max_tokens=4096, n=8))
        assert r.status_code in (200, 400, 429), r.text  # an answer, not a crash
        rss_before = _rss(gw)
        with http.stream(
            "POST", "/v1/chat/completions", json=chat_body(model="endless", stream=True)
        ) as s:
            assert s.status_code == 200
            received = b"".join(s.iter_bytes())
        assert len(received) < 4 << 20, len(received)  # cut off, not relayed without end
        assert b'"error"' in received and b"[DONE]" in received, received[-300:]
        assert _rss(gw) - rss_before < 64 << 20  # memory stayed bounded
        r = http.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 200  # the gateway is fine afterwards


def _rss(gw: Gateway) -> int:
    """Resident memory of the gateway's processes (master and workers), in bytes."""
    out = subprocess.run(
        ["ps", "-o", "rss=", "--ppid", str(gw.proc.pid), "-p", str(gw.proc.pid)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(x) for x in out.split()) * 1024


# --- Production settings -----------------------------------------------------------------


def test_manage_py_check_deploy_with_production_settings_is_clean() -> None:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "TOLLGATE_ENV": "production",
        "TOLLGATE_HTTPS": "true",
        "DJANGO_SECRET_KEY": "p" + "r0duct10n-s3cret-" * 4,
        "TOLLGATE_KEY_PEPPER": "pepper-" * 8,
        "DJANGO_ALLOWED_HOSTS": "tollgate.example.com",
        "DJANGO_CSRF_TRUSTED_ORIGINS": "https://tollgate.example.com",
        "DATABASE_URL": os.environ.get(
            "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollgate"
        ),
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout, done.stdout + done.stderr
