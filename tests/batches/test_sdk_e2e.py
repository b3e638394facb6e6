"""The batch lifecycle through the official ``openai`` SDK, against the real gateway
subprocess and simulator engines. The batch runner (what the Celery task calls) runs in
this process against the gateway's URL; its requests are billed like any other."""

import io
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import openai
import orjson
import pytest
import redis
from django.db import connection
from django.utils import timezone

from batches import runner, services
from batches.models import Batch
from tenants.keys import parse_key
from tenants.models import ApiKey
from tenants.services import issue_child_key
from tests.batches.conftest import BROKER_URL
from tests.gateway.conftest import World
from tests.gateway.test_openai_e2e import usage_event

HELLO = [{"role": "user", "content": "Say hello"}]


def broker() -> redis.Redis:
    return redis.Redis.from_url(BROKER_URL)


@pytest.fixture(autouse=True)
def internal_url(world: World, settings: object) -> Iterator[None]:
    settings.TOLLGATE_INTERNAL_URL = world.url
    settings.TOLLGATE_BATCH_CONCURRENCY = 2
    yield
    broker().delete("batches")  # the runs these tests queued; they ran in-process


def client(world: World, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=world.v1, api_key=key or world.key_a, max_retries=0)


def requests_file(n: int, model: str = "sim-chat", max_tokens: int = 6) -> io.BytesIO:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": HELLO, "max_tokens": max_tokens + i},
        }
        for i in range(n)
    ]
    return io.BytesIO(b"".join(orjson.dumps(x) + b"\n" for x in lines))


def run_in_thread(batch_id: str) -> threading.Thread:
    pk = Batch.objects.get(public_id=batch_id).pk

    def work() -> None:
        try:
            runner.run_batch(pk)
        finally:
            connection.close()

    thread = threading.Thread(target=work)
    thread.start()
    return thread


def wait_for(
    world: World, batch_id: str, done: callable, timeout: float = 60.0
) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client(world).batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} stuck in {batch.status}")


def results(world: World, file_id: str) -> list[dict]:
    return [orjson.loads(x) for x in client(world).files.content(file_id).read().splitlines()]


def test_batch_lifecycle_through_the_sdk(world: World) -> None:
    sdk = client(world)
    uploaded = sdk.files.create(file=("requests.jsonl", requests_file(5)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.filename == "requests.jsonl"
    assert sdk.files.retrieve(uploaded.id).bytes == uploaded.bytes
    batch = sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.request_counts.total == 5
    queued = [orjson.loads(m)["headers"] for m in broker().lrange("batches", 0, -1)]
    pk = Batch.objects.get(public_id=batch.id).pk
    assert {"task": "batches.run_batch", "argsrepr": f"[{pk}]"}.items() <= queued[-1].items(), (
        "the web process queues the run on the batches queue after commit"
    )

    run_in_thread(batch.id).join(timeout=60)
    done = sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and done.completed_at and done.error_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
    lines = results(world, done.output_file_id)
    assert [x["custom_id"] for x in lines] == [f"req-{i}" for i in range(5)]
    for i, item in enumerate(lines):
        body = item["response"]["body"]
        assert item["response"]["status_code"] == 200 and item["error"] is None
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6 + i
    assert done.usage.output_tokens == sum(6 + i for i in range(5))
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"

    # Billed to the key that created the batch, through the gateway's usage stream.
    parent = ApiKey.objects.get(prefix=parse_key(world.key_a))
    event = usage_event(lines[0]["response"]["request_id"])
    assert (event.api_key_id, event.tenant_id, event.completion_tokens) == (
        parent.pk,
        world.tenant_a.pk,
        6,
    )
    children = ApiKey.objects.filter(parent=parent, name=f"batch {batch.id}")
    assert children.count() == 1 and children.get().revoked_at is not None
    assert [b.id for b in sdk.batches.list()] == [batch.id]


def test_cancel_mid_run_keeps_partial_output(world: World, settings: object) -> None:
    settings.TOLLGATE_BATCH_CONCURRENCY = 1
    sdk = client(world)
    uploaded = sdk.files.create(
        file=("slow.jsonl", requests_file(8, model="sim-slow", max_tokens=10)), purpose="batch"
    )
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    thread = run_in_thread(batch.id)
    wait_for(world, batch.id, lambda b: b.request_counts.completed >= 2)
    assert sdk.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    thread.join(timeout=30)
    done = sdk.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    finished = results(world, done.output_file_id)
    unrun = results(world, done.error_file_id)
    assert 2 <= len(finished) < 8 and len(finished) + len(unrun) == 8
    assert {x["error"]["code"] for x in unrun} == {"batch_cancelled"}
    assert sorted(x["custom_id"] for x in finished + unrun) == sorted(f"req-{i}" for i in range(8))


def test_another_tenants_batch_and_file_are_not_found(world: World) -> None:
    uploaded = client(world).files.create(file=("a.jsonl", requests_file(1)), purpose="batch")
    batch = client(world).batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    bravo = client(world, world.key_b)
    with pytest.raises(openai.NotFoundError):
        bravo.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bravo.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        bravo.batches.cancel(batch.id)
    assert list(bravo.batches.list()) == [] and list(bravo.files.list()) == []


def test_bad_jsonl_is_refused_with_the_line_number(world: World) -> None:
    bad = io.BytesIO(requests_file(2).read() + b'{"custom_id": "x", "method": "POST"}\n')
    with pytest.raises(openai.BadRequestError) as caught:
        client(world).files.create(file=("bad.jsonl", bad), purpose="batch")
    assert caught.value.status_code == 400
    assert caught.value.body["message"].startswith("Line 3: url must be one of")


def test_a_batch_whose_runner_died_continues_where_it_stopped(world: World) -> None:
    """The dead runner is simulated: its claim, one stored result, its child key, its lease."""
    uploaded = client(world).files.create(file=("r.jsonl", requests_file(3)), purpose="batch")
    created = client(world).batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = Batch.objects.get(public_id=created.id)
    assert services.claim(batch.pk, "dead") is not None
    services.record_result(
        batch.pk,
        batch.lines.get(line=1).pk,
        services.result_line(
            "req-0",
            response={"status_code": 200, "request_id": "req_before", "body": {"usage": {}}},
        ),
    )
    orphan = issue_child_key(
        batch.api_key, name=f"batch {batch.public_id}", expires_at=batch.expires_at
    )
    Batch.objects.filter(pk=batch.pk).update(lease_until=timezone.now() - timedelta(seconds=1))

    assert runner.recover() == [batch.pk]
    assert runner.run_batch(batch.pk) == "completed"
    lines = results(world, client(world).batches.retrieve(created.id).output_file_id)
    assert [x["custom_id"] for x in lines] == ["req-0", "req-1", "req-2"]
    assert lines[0]["response"]["request_id"] == "req_before"  # not sent twice
    orphan.key.refresh_from_db()
    assert orphan.key.revoked_at is not None
