"""How a chained turn finds the response it continues (gateway/response_store.py)."""

from __future__ import annotations

import asyncio

import pytest

from gateway import response_store
from gateway.response_store import ResponseStore


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
