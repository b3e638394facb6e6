"""``POST /api/v1/auth/token/``: a username and password buy an admin API token, shown once,
with an expiry, in the audit log, and throttled."""

from datetime import timedelta
from typing import Any

from django.utils import timezone
from rest_framework.test import APIClient

from tenants.models import AdminToken, AuditLog
from tests.conftest import PASSWORD

URL = "/api/v1/auth/token/"


def test_a_password_buys_a_working_token_shown_once(root: Any) -> None:
    answer = APIClient().post(
        URL, {"username": "root", "password": PASSWORD, "name": "ci"}, format="json"
    )
    assert answer.status_code == 201, answer.content
    body = answer.json()
    assert body["token"].startswith(f"tga-{body['prefix']}-") and body["name"] == "ci"
    token = AdminToken.objects.get(pk=body["id"])
    assert token.user == root and body["token"] not in token.secret_hash
    lifetime = token.expires_at - timezone.now()
    assert timedelta(days=29) < lifetime <= timedelta(days=30)
    assert AuditLog.objects.filter(action="create", object_id=str(token.pk)).exists()

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {body['token']}")
    listed = client.get("/api/v1/tokens/").json()["results"]
    assert [t["id"] for t in listed] == [token.pk]
    assert "token" not in listed[0] and body["token"] not in str(listed)


def test_the_lifetime_can_be_chosen_within_a_year(root: Any) -> None:
    client = APIClient()
    body = {"username": "root", "password": PASSWORD, "expires_in_days": 2}
    answer = client.post(URL, body, format="json")
    expires = AdminToken.objects.get(pk=answer.json()["id"]).expires_at
    assert timedelta(days=1) < expires - timezone.now() <= timedelta(days=2)
    answer = client.post(URL, {**body, "expires_in_days": 366}, format="json")
    assert answer.status_code == 400
    assert [e["field"] for e in answer.json()["errors"]] == ["expires_in_days"]


def test_wrong_passwords_unknown_and_inactive_users_look_alike(root: Any, bob: Any) -> None:
    bob.is_active = False
    bob.save()
    answers = [
        APIClient().post(URL, {"username": name, "password": password}, format="json")
        for name, password in [("root", "wrong"), ("nobody", PASSWORD), ("bob", PASSWORD)]
    ]
    assert {a.status_code for a in answers} == {401}
    assert len({a.json()["detail"] for a in answers}) == 1
    assert not AdminToken.objects.exists()


def test_each_address_has_a_rate_limit_whoever_it_names(root: Any, settings: Any) -> None:
    settings.TOLLGATE_TOKEN_LOGIN_RATE = "3/min"
    client = APIClient()
    codes = [
        client.post(URL, {"username": f"u{i}", "password": "x"}, format="json").status_code
        for i in range(4)
    ]
    assert codes == [401, 401, 401, 429]
    refused = client.post(URL, {"username": "root", "password": PASSWORD}, format="json")
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1


def test_a_one_time_password_buys_no_token(root: Any) -> None:
    """Whoever was given a one-time password sets their own in the console first."""
    from tenants import services

    one_time = services.reset_password(None, root)
    answer = APIClient().post(URL, {"username": "root", "password": one_time}, format="json")
    assert answer.status_code == 403 and answer["Content-Type"] == "application/problem+json"
    assert "password" in answer.json()["detail"]
    assert not AdminToken.objects.exists()
