"""The Files and Batch APIs in-process: authentication, validation, tenant isolation, and
the batch state machine (claims, leases, results counted once, cancel, expiry)."""

from datetime import timedelta

import orjson
import pytest
import time_machine
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone

from batches import runner, services
from batches.choices import LineState, Status
from batches.models import Batch, BatchLine, File
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.batches.test_jsonl import jsonl, line

pytestmark = pytest.mark.django_db


@pytest.fixture
def key_a(tenant_a: Tenant) -> str:
    return tenant_services.issue_api_key(None, tenant_a, name="a").plaintext


@pytest.fixture
def key_b(tenant_b: Tenant) -> str:
    return tenant_services.issue_api_key(None, tenant_b, name="b").plaintext


def upload(key: str, data: bytes, purpose: str = "batch", **headers: str) -> dict:
    headers = headers or {"Authorization": f"Bearer {key}"}
    response = Client(headers=headers).post(
        "/v1/files", {"file": SimpleUploadedFile("in.jsonl", data), "purpose": purpose}
    )
    return {**response.json(), "http": response.status_code}


def create(key: str, file_id: str, **extra: object) -> dict:
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **extra,
    }
    response = Client(headers={"Authorization": f"Bearer {key}"}).post(
        "/v1/batches", orjson.dumps(body), content_type="application/json"
    )
    return {**response.json(), "http": response.status_code}


def get(key: str, path: str) -> dict:
    response = Client(headers={"Authorization": f"Bearer {key}"}).get(path)
    return {**response.json(), "http": response.status_code}


def three_lines() -> bytes:
    return jsonl(line("a"), line("b"), line("c"))


def test_every_credential_failure_is_the_same_401(key_a: str) -> None:
    answers = [
        Client(headers=h).get("/v1/files")
        for h in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": f"Bearer {key_a}x"},
            {"api-key": "tg-x"},
        )
    ]
    assert {a.status_code for a in answers} == {401}
    assert len({a.content for a in answers}) == 1
    assert answers[0].json()["error"]["code"] == "invalid_api_key"


def test_upload_with_either_header_and_read_it_back(key_a: str) -> None:
    stored = upload(key_a, three_lines(), **{"api-key": key_a})
    assert stored["http"] == 200 and stored["object"] == "file" and stored["id"].startswith("file-")
    assert (stored["bytes"], stored["purpose"], stored["filename"]) == (
        len(three_lines()),
        "batch",
        "in.jsonl",
    )
    content = Client(headers={"Authorization": f"Bearer {key_a}"}).get(
        f"/v1/files/{stored['id']}/content"
    )
    assert content.content == three_lines()
    assert get(key_a, f"/v1/files/{stored['id']}")["id"] == stored["id"]


def test_bad_jsonl_is_a_400_naming_the_line(key_a: str) -> None:
    answer = upload(key_a, jsonl(line("a"), line("a")))
    assert answer["http"] == 400
    assert answer["error"]["message"].startswith("Line 2: custom_id 'a' is already used on line 1")
    assert answer["error"]["param"] == "file" and answer["error"]["type"] == "invalid_request_error"
    assert upload(key_a, three_lines(), purpose="fine-tune")["http"] == 400
    assert not File.objects.exists()


def test_another_tenant_sees_nothing(key_a: str, key_b: str) -> None:
    file_id = upload(key_a, three_lines())["id"]
    batch_id = create(key_a, file_id)["id"]
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{batch_id}"):
        answer = Client(headers={"Authorization": f"Bearer {key_b}"}).get(path)
        assert answer.status_code == 404 and "error" in answer.json()
    assert get(key_b, "/v1/files")["data"] == [] and get(key_b, "/v1/batches")["data"] == []
    assert create(key_b, file_id)["http"] == 404
    cancel = Client(headers={"Authorization": f"Bearer {key_b}"}).post(
        f"/v1/batches/{batch_id}/cancel"
    )
    deleted = Client(headers={"Authorization": f"Bearer {key_b}"}).delete(f"/v1/files/{file_id}")
    assert (cancel.status_code, deleted.status_code) == (404, 404)
    assert Batch.objects.get().status == Status.VALIDATING and File.objects.count() == 1


def test_any_key_of_the_tenant_sees_its_batches(tenant_a: Tenant, key_a: str) -> None:
    other = tenant_services.issue_api_key(None, tenant_a, name="other").plaintext
    batch_id = create(key_a, upload(key_a, three_lines())["id"])["id"]
    assert get(other, f"/v1/batches/{batch_id}")["http"] == 200


def test_create_batch_validates_like_openai(key_a: str) -> None:
    file_id = upload(key_a, three_lines())["id"]
    assert create(key_a, file_id, endpoint="/v1/embeddings")["error"]["message"].startswith(
        "Line 1: url /v1/chat/completions does not match the batch endpoint /v1/embeddings"
    )
    assert create(key_a, file_id, completion_window="1h")["error"]["param"] == "completion_window"
    assert create(key_a, file_id, metadata={"k": 1})["error"]["param"] == "metadata"
    assert create(key_a, "file-nope")["http"] == 404
    batch = create(key_a, file_id, metadata={"team": "search"})
    assert (
        batch["http"] == 200
        and batch["id"].startswith("batch_")
        and batch["status"] == "validating"
    )
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert batch["metadata"] == {"team": "search"} and batch["model"] == "sim-chat"
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600


def test_lists_paginate_with_after_and_limit(key_a: str) -> None:
    file_id = upload(key_a, three_lines())["id"]
    ids = [create(key_a, file_id)["id"] for _ in range(3)]
    first = get(key_a, "/v1/batches?limit=2")
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = get(key_a, f"/v1/batches?limit=2&after={first['last_id']}")
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert get(key_a, "/v1/batches?limit=0")["http"] == 400


def test_deleting_a_file(key_a: str) -> None:
    file_id = upload(key_a, three_lines())["id"]
    answer = Client(headers={"Authorization": f"Bearer {key_a}"}).delete(f"/v1/files/{file_id}")
    assert answer.json() == {"id": file_id, "object": "file", "deleted": True}
    assert get(key_a, f"/v1/files/{file_id}")["http"] == 404


# --- State machine -----------------------------------------------------------------------------


def make_batch(key: str) -> Batch:
    return Batch.objects.get(public_id=create(key, upload(key, three_lines())["id"])["id"])


def ok(custom_id: str, tokens: int = 5) -> dict:
    body = {"usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}}
    return services.result_line(
        custom_id, response={"status_code": 200, "request_id": "req_1", "body": body}
    )


def test_a_batch_is_claimed_once_until_its_lease_runs_out(key_a: str) -> None:
    batch = make_batch(key_a)
    assert services.claim(batch.pk, "one").status == Status.IN_PROGRESS
    assert services.claim(batch.pk, "two") is None  # a second delivery of the task
    assert services.renew(batch.pk, "one") == Status.IN_PROGRESS
    with time_machine.travel(timezone.now() + timedelta(minutes=5)):
        assert list(services.stale_batches()) == [batch]
        assert services.claim(batch.pk, "two") is not None  # the first runner died
        assert services.renew(batch.pk, "one") is None  # … and is told so if it was only slow


def test_results_count_once(key_a: str) -> None:
    batch = make_batch(key_a)
    first = batch.lines.get(line=1)
    assert services.record_result(batch.pk, first.pk, ok("a")) is True
    assert services.record_result(batch.pk, first.pk, ok("a")) is False
    failed = services.result_line(
        "b", response={"status_code": 400, "request_id": "r", "body": {"error": {}}}
    )
    services.record_result(batch.pk, batch.lines.get(line=2).pk, failed)
    batch.refresh_from_db()
    assert (batch.completed, batch.failed, batch.input_tokens, batch.output_tokens) == (1, 1, 3, 5)


def test_cancelling_a_batch_nobody_runs_settles_it_at_once(key_a: str) -> None:
    batch = make_batch(key_a)
    answer = Client(headers={"Authorization": f"Bearer {key_a}"}).post(
        f"/v1/batches/{batch.public_id}/cancel"
    )
    assert answer.json()["status"] == Status.CANCELLED and answer.json()["cancelled_at"]
    errors = File.objects.get(public_id=answer.json()["error_file_id"])
    lines = [orjson.loads(x) for x in bytes(errors.content).splitlines()]
    assert [(x["custom_id"], x["error"]["code"]) for x in lines] == [
        ("a", "batch_cancelled"),
        ("b", "batch_cancelled"),
        ("c", "batch_cancelled"),
    ]
    assert runner.run_batch(batch.pk) == "not claimed"
    again = Client(headers={"Authorization": f"Bearer {key_a}"}).post(
        f"/v1/batches/{batch.public_id}/cancel"
    )
    assert again.json()["status"] == Status.CANCELLED


def test_a_finished_batch_cannot_be_cancelled(key_a: str) -> None:
    batch = make_batch(key_a)
    services.claim(batch.pk, "one")
    for item in batch.lines.all():
        services.record_result(batch.pk, item.pk, ok(item.custom_id))
    Batch.objects.filter(pk=batch.pk).update(status=Status.FINALIZING)
    assert services.finalize(batch.pk, Status.FINALIZING, Status.COMPLETED)
    answer = Client(headers={"Authorization": f"Bearer {key_a}"}).post(
        f"/v1/batches/{batch.public_id}/cancel"
    )
    assert answer.status_code == 409
    batch.refresh_from_db()
    assert batch.output_file_id and not batch.error_file_id and batch.completed == 3


def test_a_batch_past_its_window_expires_keeping_its_results(key_a: str) -> None:
    batch = make_batch(key_a)
    services.claim(batch.pk, "one")
    services.record_result(batch.pk, batch.lines.get(line=1).pk, ok("a"))
    with time_machine.travel(timezone.now() + timedelta(hours=25)):
        assert runner.run_batch(batch.pk) == Status.EXPIRED
    batch.refresh_from_db()
    output = [
        orjson.loads(x)
        for x in bytes(File.objects.get(public_id=batch.output_file_id).content).splitlines()
    ]
    errors = [
        orjson.loads(x)
        for x in bytes(File.objects.get(public_id=batch.error_file_id).content).splitlines()
    ]
    assert [x["custom_id"] for x in output] == ["a"]
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        ("b", "batch_expired"),
        ("c", "batch_expired"),
    ]
    assert batch.expired_at and BatchLine.objects.filter(state=LineState.PENDING).count() == 2


def test_a_batch_whose_key_was_revoked_fails(tenant_a: Tenant, key_a: str) -> None:
    batch = make_batch(key_a)
    tenant_services.revoke_api_key(None, batch.api_key)
    assert runner.run_batch(batch.pk) == Status.FAILED
    batch.refresh_from_db()
    assert batch.errors["data"][0]["code"] == "api_key_unusable" and batch.failed_at


def test_files_over_the_size_limit_are_refused(key_a: str, settings: object) -> None:
    settings.TOLLGATE_BATCH_MAX_FILE_BYTES = 100
    answer = upload(key_a, three_lines())
    assert answer["http"] == 400 and answer["error"]["code"] == "file_too_large"
