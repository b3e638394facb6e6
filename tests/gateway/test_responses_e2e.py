"""/v1/responses end to end through the official openai SDK: the real gateway in front of
simulator engines that serve /v1/responses as vLLM does (without their own store)."""

import openai
import pytest

from tests.gateway.conftest import World
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)


def client(world: World, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=world.v1, api_key=key or world.key_a, max_retries=0)


def test_create_retrieve_list_and_delete(world: World) -> None:
    c = client(world)
    raw = c.responses.with_raw_response.create(
        model="sim-chat", input="Name three colours.", instructions="Be brief.", max_output_tokens=9
    )
    response = raw.parse()
    assert response.id.startswith("resp_") and response.status == "incomplete"
    assert response.output_text and response.usage.output_tokens == 9
    event = usage_event(raw.headers["x-request-id"])
    assert event.endpoint == "responses"
    assert (event.prompt_tokens, event.completion_tokens) == (response.usage.input_tokens, 9)
    again = c.responses.retrieve(response.id)
    assert again.output_text == response.output_text and again.usage == response.usage
    items = c.responses.input_items.list(response.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "Name three colours.")
    ]
    c.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(response.id)
