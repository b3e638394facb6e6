"""How a chained turn finds the response it continues (gateway/response_store.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from core.keyspace import stored_response_key
from gateway import response_store
from gateway.redispipe import RedisPipe
from gateway.response_store import ResponseStore
from tests.gateway.test_redispipe import Server


class Arriving(ResponseStore):
    """A store whose record shows up only at the given look (as when the client's next turn
    overtook the write on the network); ``None``: never (an unknown or deleted id)."""

    def __init__(self, found_at: int | None) -> None:
        super().__init__(client=None, pipe=None)  # type: ignore[arg-type]
        self.found_at, self.looks = found_at, 0

    async def get(self, tenant_id: int, response_id: str) -> dict | None:
        self.looks += 1
        return {"id": response_id} if self.looks == self.found_at else None


@pytest.fixture(autouse=True)
def short_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(response_store, "CHAIN_RETRIES", (0.001, 0.002, 0.004))


@pytest.mark.parametrize("found_at", [1, 2, 4])
def test_a_record_that_arrives_while_the_turn_looks_is_found(found_at: int) -> None:
    store = Arriving(found_at)
    assert asyncio.run(store.get_chained(7, "resp_x")) == {"id": "resp_x"}
    assert store.looks == found_at


def test_an_unknown_response_is_final_after_the_last_look() -> None:
    store = Arriving(None)
    assert asyncio.run(store.get_chained(7, "resp_x")) is None
    assert store.looks == len(response_store.CHAIN_RETRIES) + 1


def test_a_write_redis_refuses_for_a_lost_script_is_sent_again(tmp_path: Path) -> None:
    """Redis restarted between two writes (its scripts are gone): the record still lands."""
    server = Server(tmp_path).start()
    try:
        client = server.client()

        async def scenario() -> None:
            store = ResponseStore(client=None, pipe=RedisPipe(port=server.port))  # type: ignore[arg-type]
            try:
                await store.start_put(record("resp_one"))
                await until(lambda: client.exists(stored_response_key(7, "resp_one")))
                client.script_flush()
                await store.start_put(record("resp_two"))
                await until(lambda: client.exists(stored_response_key(7, "resp_two")))
            finally:
                await store.pipe.aclose()

        asyncio.run(scenario())
        kept = orjson.loads(client.get(stored_response_key(7, "resp_two")))
        assert kept["response"] == {"status": "completed"}
    finally:
        server.stop()


def record(response_id: str) -> dict:
    return {"id": response_id, "tenant_id": 7, "response": {"status": "completed"}}


async def until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not written in time"
        await asyncio.sleep(0.01)
