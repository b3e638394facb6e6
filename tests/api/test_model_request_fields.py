"""A catalogue model's allowed request fields (the engine shield's per-model allowance,
docs/admins/engine-shield.md): set by platform admins through the API and the console,
validated, audited, shown on the model's page; tenants may read them, never set them."""

from collections.abc import Callable

from django.test import Client
from rest_framework.test import APIClient

from tenants.models import AuditLog
from tests.api.conftest import World

ALLOWED = ["chat_template_kwargs.documents_mode", "mm_processor_kwargs"]


def test_a_platform_admin_sets_them_and_the_change_is_audited(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    root = client_for(world.root)
    path = f"/api/v1/models/{world.public_model.served_name}/"
    assert root.get(path).json()["allowed_request_fields"] == []
    answer = root.patch(path, {"allowed_request_fields": ALLOWED}, format="json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["allowed_request_fields"] == ALLOWED
    entry = AuditLog.objects.filter(object_type="catalogmodel", action="update").latest("id")
    assert entry.changes == {"allowed_request_fields": [[], ALLOWED]}
    assert entry.actor == world.root


def test_anything_but_guarded_field_names_is_refused_with_the_names_it_takes(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    root = client_for(world.root)
    path = f"/api/v1/models/{world.public_model.served_name}/"
    for given, words in (
        (["kv_transfer_params"], "kv_transfer_params cannot be allowed: give one of"),
        (["chat_template_kwargs.bad key"], "the key must be a plain name"),
        (["chat_template", "chat_template"], "Each field may appear once."),
        ("chat_template", "Give a list of field names"),
        ([7], "7 is not a field name."),
    ):
        answer = root.patch(path, {"allowed_request_fields": given}, format="json")
        assert answer.status_code == 400, (given, answer.content)
        assert words in answer.content.decode(), answer.content
    world.public_model.refresh_from_db()
    assert world.public_model.allowed_request_fields == []


def test_tenants_read_them_but_cannot_set_them(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    world.public_model.allowed_request_fields = ["chat_template"]
    world.public_model.save()
    alice = client_for(world.alice)
    path = f"/api/v1/models/{world.public_model.served_name}/"
    assert alice.get(path).json()["allowed_request_fields"] == ["chat_template"]
    refused = alice.patch(path, {"allowed_request_fields": ["vllm_xargs"]}, format="json")
    assert refused.status_code == 403
    world.public_model.refresh_from_db()
    assert world.public_model.allowed_request_fields == ["chat_template"]


def test_the_console_form_takes_them_comma_separated_and_the_page_shows_them(
    world: World,
) -> None:
    console = Client()
    console.force_login(world.root)
    model = world.public_model
    form = console.get(f"/models/{model.pk}/edit/")
    assert form.status_code == 200 and b"Request fields allowed" in form.content
    data = {
        "served_name": model.served_name,
        "source": model.source,
        "task": model.task,
        "params_billions": "8.2",
        "quantization": "",
        "context_length": model.context_length,
        "visibility": model.visibility,
        "allowed_request_fields": "mm_processor_kwargs, chat_template_kwargs.documents_mode",
        "description": "",
    }
    saved = console.post(f"/models/{model.pk}/edit/", data)
    assert saved.status_code == 302, saved.content.decode()[-2000:]
    model.refresh_from_db()
    assert model.allowed_request_fields == [
        "mm_processor_kwargs",
        "chat_template_kwargs.documents_mode",
    ]
    page = console.get(f"/models/{model.pk}/")
    assert b"mm_processor_kwargs, chat_template_kwargs.documents_mode" in page.content
    wrong = console.post(
        f"/models/{model.pk}/edit/", {**data, "allowed_request_fields": "request_id"}
    )
    assert wrong.status_code == 400
    assert b"request_id cannot be allowed" in wrong.content
    model.refresh_from_db()
    assert model.allowed_request_fields == [
        "mm_processor_kwargs",
        "chat_template_kwargs.documents_mode",
    ]
