"""/v1/rerank and /v1/score on a cross-encoder through the gateway (httpx with a tenant key,
as RAG stacks call them): the engine's answer, billed as prompt tokens; the wrong kind of
model is refused in OpenAI's shape."""

from collections.abc import Iterator
from decimal import Decimal

import httpx
import pytest

from deployments.choices import Task
from deployments.models import Node
from metering import services as metering_services
from tests.gateway.conftest import (
    Engine,
    World,
    deploy,
    make_model,
    start_engine,
    stop,
    wait_until_served,
)
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = "sim-rerank"
QUERY = "How does the gateway bill a cut stream?"
DOCS = [
    "Bananas are rich in potassium.",
    "The gateway bills a cut stream for its prompt and the tokens it delivered.",
    "Rivers flow into the sea.",
]


@pytest.fixture(scope="module")
def rerank_engine() -> Iterator[Engine]:
    """A cross-encoder: vLLM's pooling runner on a reranker checkpoint."""
    engine, proc = start_engine((MODEL,), "--runner", "pooling")
    yield engine
    stop(proc)


@pytest.fixture
def rerank(world: World, rerank_engine: Engine) -> World:
    model = make_model(MODEL, task=Task.SCORE)
    deploy(model, Node.objects.get(name="sim-node"), rerank_engine.port)
    metering_services.set_price(None, model, Decimal("0.10"), None, Decimal("0"))
    wait_until_served(world.url, world.key_a, MODEL)
    return world


def post(world: World, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or world.key_a}"}
    return httpx.post(f"{world.url}{path}", json=body, headers=headers, timeout=30)


def test_rerank_orders_the_documents_and_bills_the_prompt(
    rerank: World, rerank_engine: Engine
) -> None:
    body = {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 2}
    answer = post(rerank, "/v1/rerank", body)
    assert answer.status_code == 200
    direct = httpx.post(f"{rerank_engine.url}/v1/rerank", json=body, timeout=30).json()
    results = answer.json()["results"]
    assert results == direct["results"] and len(results) == 2
    assert results[0]["index"] == 1  # the relevant document first
    event = usage_event(answer.headers["x-request-id"])
    assert event.endpoint == "rerank" and event.status == "ok"
    assert event.prompt_tokens == direct["usage"]["total_tokens"] > 0
    assert event.completion_tokens == 0


def test_score_pairs_and_bills_the_prompt(rerank: World) -> None:
    answer = post(rerank, "/v1/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCS})
    assert answer.status_code == 200
    scores = [d["score"] for d in answer.json()["data"]]
    assert len(scores) == 3 and max(scores) == scores[1]
    event = usage_event(answer.headers["x-request-id"])
    assert event.endpoint == "score"
    assert event.prompt_tokens == answer.json()["usage"]["prompt_tokens"] > 0


def test_the_wrong_kind_of_model_is_a_clear_400(rerank: World) -> None:
    answer = post(rerank, "/v1/rerank", {"model": "sim-chat", "query": QUERY, "documents": DOCS})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_supported", "model")
    assert "/v1/rerank" in error["message"] and "chat/completion" in error["message"]
    answer = post(
        rerank,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert answer.status_code == 400
    assert "rerank/score model" in answer.json()["error"]["message"]


def test_unknown_models_and_bad_keys_are_refused(rerank: World) -> None:
    body = {"model": "no-such-reranker", "query": QUERY, "documents": DOCS}
    answer = post(rerank, "/v1/rerank", body)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    answer = post(rerank, "/v1/score", {**body, "model": MODEL}, key="tg-nope-" + "x" * 40)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
