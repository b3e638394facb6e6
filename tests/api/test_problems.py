"""One error shape for all of /api/: RFC 9457 problem details, for every status the API
answers with, on DRF views and on paths no view serves; unknown fields are refused by name on
every write endpoint."""

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from deployments.models import AllowedImage, EngineProfile
from deployments.profiles import ensure_builtin_profiles
from tenants.models import AdminToken
from tests.api.conftest import World, db_state, router_endpoints, router_lookup_count
from tests.conftest import PASSWORD

PROBLEM = "application/problem+json"
WRITES = sorted(e for e in router_endpoints() if e[1] in ("POST", "PUT", "PATCH", "DELETE"))


def assert_problem(response: Any, status: int) -> dict[str, Any]:
    """The response is a problem+json document of RFC 9457's shape with this status."""
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"] == PROBLEM
    body = json.loads(response.content)
    assert set(body) - {"errors"} == {"type", "title", "status", "detail", "instance"}, body
    assert body["status"] == status
    assert body["type"].startswith("/api/problems/") and body["title"] and body["detail"]
    assert body["instance"] == response.wsgi_request.path
    for error in body.get("errors", []):
        assert set(error) == {"field", "message"} and error["message"], body
    return body


def _target(route: str, world: World) -> Any:
    """The lookup value of a detail route: one existing object of each resource."""
    resource = route.split("-", 1)[0]
    targets: dict[str, Callable[[], Any]] = {
        "tenant": lambda: world.tenant_a.slug,
        "apikey": lambda: world.alice_key.pk,
        "membership": lambda: world.alice_membership.pk,
        "user": lambda: world.alice.username,
        "admintoken": lambda: AdminToken.objects.filter(user=world.root).first().pk,
        "catalogmodel": lambda: world.public_model.served_name,
        "adapter": lambda: world.adapter_a.served_name,
        "price": lambda: world.public_price.pk,
        "node": lambda: world.node.name,
        "deployment": lambda: world.deployment.name,
        "operation": lambda: world.operation.pk,
        "engineprofile": lambda: (ensure_builtin_profiles(), EngineProfile.objects.first())[1].name,
        "allowedimage": lambda: AllowedImage.objects.create(pattern="example/engine:*").pk,
        "webhookendpoint": lambda: world.webhook_a.pk,
        "webhookdelivery": lambda: world.delivery_a.pk,
        "notice": lambda: world.notice_a.pk,
    }
    return targets[resource]()


def _caller(route: str, world: World, client_for: Callable[..., APIClient]) -> APIClient:
    """The platform admin, or for the node agents' join a (made-up) join token."""
    if route != "node-join":
        return client_for(world.root)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer tgj-aaaaaaaa-" + "b" * 40)
    return client


@pytest.mark.parametrize(("route", "method"), WRITES, ids=[" ".join(e) for e in WRITES])
def test_every_write_endpoint_refuses_an_unknown_field_by_name(
    route: str, method: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    client = _caller(route, world, client_for)
    args = [_target(route, world)] if router_lookup_count(route) else []
    before = db_state()  # after the client's token and the target exist
    response = client.generic(
        method,
        reverse(route, args=args),
        data=json.dumps({"priority_class": "P0"}),
        content_type="application/json",
    )
    body = assert_problem(response, 400)
    assert {"field": "priority_class", "message": body["errors"][0]["message"]} in body["errors"]
    assert "priority_class" in body["detail"]
    assert db_state() == before


def test_the_token_login_refuses_an_unknown_field_by_name(world: World) -> None:
    body = {"username": "root", "password": PASSWORD, "scope": "all"}
    response = APIClient().post("/api/v1/auth/token/", body, format="json")
    assert [e["field"] for e in assert_problem(response, 400)["errors"]] == ["scope"]


def test_read_only_fields_are_refused_not_ignored(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    response = client_for(world.root).patch(
        "/api/v1/tenants/acme/", {"status": "suspended"}, format="json"
    )
    body = assert_problem(response, 400)
    assert body["errors"] == [{"field": "status", "message": "This field is read-only."}]
    world.tenant_a.refresh_from_db()
    assert world.tenant_a.status == "active"


@pytest.mark.parametrize(("route", "method"), WRITES, ids=[" ".join(e) for e in WRITES])
def test_a_body_that_is_not_an_object_is_a_400(
    route: str, method: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    """Schemathesis found ``[null, null]`` answered with a 500 page on POST /members/."""
    client = _caller(route, world, client_for)
    args = [_target(route, world)] if router_lookup_count(route) else []
    response = client.generic(
        method, reverse(route, args=args), data="[null, null]", content_type="application/json"
    )
    body = assert_problem(response, 400)
    assert body["type"] == "/api/problems/malformed-request"
    assert body["detail"] == "The body must be a JSON object."


def test_validation_errors_list_each_field_inside_the_problem(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    body = {"tenant": "acme", "requests_per_minute": -1, "allowed_models": ["nope"]}
    response = client_for(world.alice).post("/api/v1/keys/", body, format="json")
    problem = assert_problem(response, 400)
    assert problem["type"] == "/api/problems/validation-error"
    assert sorted(e["field"] for e in problem["errors"]) == [
        "allowed_models",
        "name",
        "requests_per_minute",
    ]


def test_401_is_a_problem_with_the_auth_scheme(world: World) -> None:
    response = APIClient().get("/api/v1/tenants/")
    body = assert_problem(response, 401)
    assert response["WWW-Authenticate"] == "Bearer"
    assert body["type"] == "/api/problems/not-authenticated"


def test_403_is_a_problem(world: World, client_for: Callable[..., APIClient]) -> None:
    response = client_for(world.bob).post("/api/v1/tenants/acme/suspend/")
    assert assert_problem(response, 403)["type"] == "/api/problems/permission-denied"


@pytest.mark.parametrize(
    "path",
    ["/api/v1/tenants/nope/", "/api/v1/no-such-resource/", "/api/nothing", "/api/v1/keys/x/y/z/"],
)
def test_404_is_a_problem_on_views_and_on_paths_no_view_serves(
    path: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    response = client_for(world.root).get(path)
    assert assert_problem(response, 404)["type"] == "/api/problems/not-found"


def test_pages_outside_the_api_keep_the_consoles_404(world: World) -> None:
    response = APIClient().get("/no-such-page/")
    assert response.status_code == 404 and response["Content-Type"].startswith("text/html")


def test_405_is_a_problem_with_allow(world: World, client_for: Callable[..., APIClient]) -> None:
    response = client_for(world.root).put("/api/v1/tenants/", {}, format="json")
    assert assert_problem(response, 405)["type"] == "/api/problems/method-not-allowed"
    assert "POST" in response["Allow"]
    response = client_for(world.root).delete(f"/api/v1/keys/{world.alice_key.pk}/")
    assert_problem(response, 405)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/api/v1/tenants/", {"name": "Acme again", "slug": "acme"}),
        ("post", "/api/v1/members/", {"tenant": "acme", "user": "bob", "role": "admin"}),
        ("delete", "/api/v1/nodes/spark-1/", None),
        ("post", "/api/v1/engine-profiles/", {"name": "dgx-spark", "image": "x"}),
    ],
    ids=["taken slug", "already a member", "node in use", "taken profile name"],
)
def test_409_is_a_problem_naming_the_conflict(
    method: str,
    path: str,
    body: dict[str, Any] | None,
    world: World,
    client_for: Callable[..., APIClient],
) -> None:
    ensure_builtin_profiles()  # a transactional test before may have flushed them
    client = client_for(world.root)
    before = db_state()
    response = getattr(client, method)(path, body, format="json")
    problem = assert_problem(response, 409)
    assert problem["type"] == "/api/problems/conflict"
    assert db_state() == before


def test_429_is_a_problem_with_retry_after(world: World, settings: Any) -> None:
    """The failure that reaches the limit locks the username out from this address; then
    even the right password is refused until the lockout ends."""
    settings.AXES_FAILURE_LIMIT = 2
    client = APIClient()
    wrong = {"username": "root", "password": "wrong"}
    assert_problem(client.post("/api/v1/auth/token/", wrong, format="json"), 401)
    for password in ["wrong", PASSWORD]:
        body = {"username": "root", "password": password}
        answer = client.post("/api/v1/auth/token/", body, format="json")
        assert assert_problem(answer, 429)["type"] == "/api/problems/too-many-requests"
        assert int(answer["Retry-After"]) > 60
    assert not AdminToken.objects.filter(user=world.root).exists()


def test_500_is_a_problem_and_says_nothing_of_the_cause(
    world: World, client_for: Callable[..., APIClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr("tenants.access.tenants_of", explode)
    client = client_for(world.root)
    client.raise_request_exception = False
    response = client.get("/api/v1/tenants/")
    body = assert_problem(response, 500)
    assert "secret internals" not in response.content.decode()
    assert body["type"] == "/api/problems/server-error"


def test_problem_types_resolve(world: World) -> None:
    listing = APIClient().get("/api/problems/").json()["problems"]
    assert {p["status"] for p in listing} >= {400, 401, 403, 404, 405, 409, 429, 500}
    for entry in listing:
        one = APIClient().get(entry["type"])
        assert one.status_code == 200 and one.json() == entry


def test_a_missing_final_slash_redirects_reads_and_names_the_path_for_writes(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    api = client_for(world.root)
    read = api.get("/api/v1/tenants", {"status": "active"})
    assert read.status_code == 301 and read["Location"] == "/api/v1/tenants/?status=active"
    write = api.post("/api/v1/tenants", {"name": "X"}, format="json")
    assert "/api/v1/tenants/" in assert_problem(write, 404)["detail"]
