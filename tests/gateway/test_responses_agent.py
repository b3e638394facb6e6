"""A coding agent's session on /v1/responses, replayed in the shape such clients send it
(Codex-style: a long system prompt as ``instructions``, tools, streamed turns, the whole
history sent back each turn with ``store: false``): the usage CSV bills exactly the usage
the client was shown, to the token."""

import csv
import io
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal

import openai
import pytest
from django.utils import timezone

from deployments import services as deployment_services
from deployments.choices import Task
from deployments.models import Node
from metering import export, ingest
from metering import services as metering_services
from tests.gateway.conftest import Engine, World, deploy, start_engine, stop, wait_until_served
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
CONTEXT = 65536
# ~12k tokens: a coding agent's system prompt (rules, tool docs, repository map).
SYSTEM = "You are a careful coding agent working in a Django repository. " + " ".join(
    f"Rule {n}: read the file before editing it, run the tests after." for n in range(1000)
)
TOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
    {
        "type": "function",
        "name": "run_tests",
        "description": "Run the test suite.",
        "parameters": {"type": "object", "properties": {}},
    },
]
TASKS = [
    "Find where the gateway settles usage.",
    "Explain how a request is admitted.",
    "Which test covers the orphan reaper?",
]


@pytest.fixture(scope="module")
def agent_engine() -> Iterator[Engine]:
    """An engine with a long context that reasons and calls tools, like an agent's model."""
    engine, proc = start_engine(
        ("sim-agent",),
        "--max-model-len",
        str(CONTEXT),
        "--sim-tool-calls",
        "--sim-reasoning",
        "--sim-ttft-ms",
        "2",
        "--sim-decode-tps",
        "2000",
    )
    yield engine
    stop(proc)


def test_agent_session_usage_csv_equals_the_usage_the_client_saw(
    world: World, agent_engine: Engine
) -> None:
    model = deployment_services.create_model(
        None,
        served_name="sim-agent",
        source="sim/sim-agent",
        task=Task.GENERATE,
        params_billions=Decimal("8"),
        context_length=CONTEXT,
    )
    metering_services.set_price(None, model, Decimal("1.00"), Decimal("0.10"), Decimal("4.00"))
    deploy(model, Node.objects.get(name="sim-node"), agent_engine.port)
    wait_until_served(world.url, world.key_a, "sim-agent")
    client = openai.OpenAI(base_url=world.v1, api_key=world.key_a, max_retries=0)
    started = timezone.now()

    history: list[dict] = []
    shown = {"input": 0, "cached": 0, "output": 0, "reasoning": 0}
    calls = requests = 0
    for task in TASKS:
        history.append({"role": "user", "content": task})
        while True:
            with client.responses.stream(
                model="sim-agent",
                instructions=SYSTEM,
                input=history,
                tools=TOOLS,
                store=False,
                max_output_tokens=96,
            ) as stream:
                deltas = sum(1 for e in stream if e.type.endswith(".delta"))
                final = stream.get_final_response()
                request_id = stream._response.headers["x-request-id"]
            requests += 1
            usage = final.usage
            shown["input"] += usage.input_tokens
            shown["cached"] += usage.input_tokens_details.cached_tokens
            shown["output"] += usage.output_tokens
            shown["reasoning"] += usage.output_tokens_details.reasoning_tokens
            # Every generated token streamed as a delta but a tool call's name.
            named = [o for o in final.output if o.type == "function_call"]
            assert deltas == usage.output_tokens - len(named)
            event = usage_event(request_id)
            assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (
                usage.input_tokens,
                usage.input_tokens_details.cached_tokens,
                usage.output_tokens,
            )
            assert event.reasoning_tokens == usage.output_tokens_details.reasoning_tokens
            history += [o.to_dict() for o in final.output]
            if not named:
                assert final.output_text
                break
            calls += 1
            history.append(
                {
                    "type": "function_call_output",
                    "call_id": named[0].call_id,
                    "output": f"{named[0].name} ok: 3 matches in gateway/exchange.py",
                }
            )

    assert calls == len(TASKS) and requests == 2 * len(TASKS)
    assert shown["input"] > 10_000 * requests  # the system prompt is in every turn
    assert shown["cached"] > 0 and shown["reasoning"] > 0  # prefix caching, a reasoning model
    # Nothing kept: the session asked for store=false.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)

    ingest.drain("agent-test", seconds=30)
    query = export.ExportQuery(
        start=started - timedelta(hours=1),
        end=timezone.now() + timedelta(hours=1),
        granularity="month",
        tenant_ids=frozenset({world.tenant_a.pk}),
        model="sim-agent",
    )
    rows = list(csv.DictReader(io.StringIO("".join(export.csv_lines(query)))))
    assert rows and all(r["model"] == "sim-agent" for r in rows)
    billed = {
        "requests": sum(int(r["requests"]) for r in rows),
        "input": sum(int(r["prompt_tokens"]) for r in rows),
        "cached": sum(int(r["cached_tokens"]) for r in rows),
        "output": sum(int(r["completion_tokens"]) for r in rows),
    }
    assert billed == {
        "requests": requests,
        "input": shown["input"],
        "cached": shown["cached"],
        "output": shown["output"],
    }
    # Priced per input / cached input / output token like chat.
    expected_cost = (
        Decimal(shown["input"] - shown["cached"]) * Decimal("1.00")
        + Decimal(shown["cached"]) * Decimal("0.10")
        + Decimal(shown["output"]) * Decimal("4.00")
    ) / 1_000_000
    assert abs(sum(Decimal(r["cost"]) for r in rows) - expected_cost) < Decimal("0.000001")
