"""The fidelity scenarios of LoRA adapters (issue 29): the simulator held to the real vLLM for
the adapter API, requests on adapters, the adapter slot and the worker's adapter cache.

Both engines are started with ``LORA_ENGINE_FLAGS`` and ``LORA_ENV``: the shared scenarios'
flags plus adapters enabled (one slot, two kept read, ranks up to 8, adapter ``a`` named at
start, loading at run time allowed). The real one is the session's ``lora_engine``, which
the adapter tests (tests/vllm/test_adapters.py) use too, not the shared engine: the
scenarios here change what the engine serves (loads, unloads), and ``--enable-lora``
changes the real engine itself (every layer wrapped for adapters, a metric family more),
which the shared scenarios, the image test and others sharing that engine must not see.

The adapters are the test model's (scripts/make-test-model): ``a`` and ``b`` rank 8, ``c``
rank 16; the simulator reads the same files, copied out of the stage's model volume.
Scenarios are independent of their order: each loads or unloads what it needs first
(``before``).

What the real engine does, found on vLLM 0.32 (CPU, 2 cores, the test adapters of 30 KB;
2026-11-28), and what Tollgate's design rests on:

- Unloading an adapter only takes its name out of the API server's table (vLLM's
  ``unload_lora_adapter`` never calls the engine): a stream running on it when it is unloaded
  goes on to its last token, usage and ``[DONE]`` (no error frame; by hand: unloaded 1.4 s
  into a 1,500-token stream, which ran 6 s more and ended ``length`` with all its usage), and
  so does a request on it still waiting for the adapter slot. New requests naming it get the
  unknown-model 404 at once. The worker keeps the weights in its cache until it needs the
  room.
- ``--max-loras`` different adapters run at once: a request on another one waits (vLLM
  defers it, ``vllm:num_requests_waiting_by_reason{reason="deferred"}``) until no request on
  the running adapter is left; requests on the base, or on the running adapter, pass it.
  Nothing is refused.
- The worker keeps ``--max-cpu-loras`` adapters read (default ``--max-loras``); loading
  another, or a request on one it let go, reads the adapter again from its path (the request
  carries it), pushing out the least recently used. So every adapter loaded still answers,
  and the same. For these 30 KB adapters a swap costs nothing measurable (median request
  130-156 ms with the adapters kept read, 135-144 ms with every request reading one again);
  a real adapter costs a read of its safetensors file and a copy into the slot. If its files
  are gone by then, vLLM's worker raises inside the engine loop: the engine dies (that
  request gets 500 ``EngineCore encountered an issue…``, the others fail, the server exits;
  by hand, with the adapter's folder deleted after it was pushed out). An adapter's files
  must outlive its last unload from every engine and every request already sent on it
  (vllm:lora_requests_info names the adapters with requests in the engine).
- ``POST /v1/load_lora_adapter`` took 50-110 ms (median 70 ms, 10 loads) on an idle engine,
  0.7 s while a stream ran; an unload 50 ms idle, 0.4-2.4 s while a stream ran (the API
  server shares two cores with the engine loop). On a busy machine it can be longer still:
  once the API server falls behind the engine's output it answers nothing (not even
  ``/health``) until the engine stops, so an admin call can wait as long as the longest
  reply running.
"""

from __future__ import annotations

from tests.vllm.fidelity_scenarios import (
    ENGINE_FLAGS,
    ERROR,
    MODEL,
    OPENAI_IDS,
    PROMPT_COUNT,
    RANDOM_ID,
    TEXT,
    USAGE_DELIBERATE,
    Scenario,
    chat,
    completion,
)

TEST_MODEL = "tollgate-test/tiny-llama"  # as tests/vllm/conftest.py (this module stays Django-free)
ADAPTER_RANKS = {"a": 8, "b": 8, "c": 16}


def repo(name: str) -> str:
    """The test adapter's repository id in the model cache."""
    return f"{TEST_MODEL}-lora-{name}"


LORA_ENGINE_FLAGS = (
    *ENGINE_FLAGS,
    "--enable-lora",
    "--max-lora-rank",
    "8",
    "--max-loras",
    "1",
    "--max-cpu-loras",
    "2",
    "--lora-modules",
    f"a={repo('a')}",
)
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


def load(name: str, adapter: str) -> tuple[str, dict]:
    return LOAD, {"lora_name": name, "lora_path": repo(adapter)}


def unload(name: str) -> tuple[str, dict]:
    return UNLOAD, {"lora_name": name}


TEXT_ANSWER = ("status", "content_type", "body")
CARD = ("id", "object", "owned_by", "root", "parent", "max_model_len")
# Tokens: the longest reply the test model's context holds after a short prompt (6-7 s on
# the CPU engine with an adapter, 4.75 s on the simulator), and one long enough to be seen
# running beside it.
LONG = 1900
BESIDE = 400

LORA_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "lora_models_list",
        "/v1/models",
        method="GET",
        before=(load("b", "b"),),
        same=("status", *(f"body.data[{i}].{key}" for i in range(3) for key in CARD)),
        expect={"body.data[1].id": "a", "body.data[2].id": "b", "body.data[2].parent": MODEL},
        deliberate={"body.data[*].created": "the time", "body.data[*].permission": RANDOM_ID},
    ),
    Scenario(
        "lora_load",
        LOAD,
        {"lora_name": "b", "lora_path": repo("b")},
        before=(unload("b"),),
        same=TEXT_ANSWER,
        expect={"status": 200, "content_type": ""},
    ),
    Scenario(
        "lora_load_twice",
        LOAD,
        {"lora_name": "b", "lora_path": repo("b")},
        before=(load("b", "b"),),
        same=(*ERROR, "body.error.message"),
        expect={"status": 400},
    ),
    Scenario(
        "lora_load_missing_path",
        LOAD,
        {"lora_name": "c", "lora_path": "/nonexistent"},
        same=(*ERROR, "body.error.message"),
        expect={"status": 404},
    ),
    Scenario(
        # The worker's failure, word for word: Tollgate checks the rank before it loads.
        "lora_load_rank_too_large",
        LOAD,
        {"lora_name": "c", "lora_path": repo("c")},
        same=(*ERROR, "body.error.message"),
        expect={"status": 500},
    ),
    Scenario(
        "lora_load_base_name",
        LOAD,
        {"lora_name": MODEL, "lora_path": repo("b")},
        same=(*ERROR, "body.error.message"),
        expect={"status": 400},
    ),
    Scenario(
        "lora_load_empty_name",
        LOAD,
        {"lora_name": "", "lora_path": repo("b")},
        same=(*ERROR, "body.error.message"),
        expect={"status": 400},
    ),
    Scenario(
        "lora_load_without_path",
        LOAD,
        {"lora_name": "c"},
        same=(*ERROR, "body.error.message"),
        expect={"status": 400},
    ),
    Scenario(
        "lora_unload",
        UNLOAD,
        {"lora_name": "b"},
        before=(load("b", "b"),),
        same=TEXT_ANSWER,
        expect={"status": 200},
    ),
    Scenario(
        "lora_unload_unknown",
        UNLOAD,
        {"lora_name": "b"},
        before=(unload("b"),),
        same=(*ERROR, "body.error.message"),
        expect={"status": 404},
    ),
    Scenario(
        "lora_unload_empty_name",
        UNLOAD,
        {"lora_name": ""},
        same=(*ERROR, "body.error.message"),
        expect={"status": 400},
    ),
    Scenario(
        # The unknown-model error: its "Valid aliases" name the base only, never an adapter.
        "lora_unloaded_adapter_chat",
        "/v1/chat/completions",
        chat(model="b"),
        before=(load("b", "b"), unload("b")),
        same=(*ERROR, "body.error.message"),
        expect={"status": 404},
    ),
    Scenario(
        "lora_chat",
        "/v1/chat/completions",
        chat(model="b"),
        before=(load("b", "b"),),
        same=(
            "status",
            "content_type",
            "body.object",
            "body.model",
            "body.choices[0].finish_reason",
            "body.choices[0].message.role",
            "body.usage.completion_tokens",
            "body.usage.prompt_tokens_details.cached_tokens",
        ),
        expect={"body.model": "b"},
        deliberate={**OPENAI_IDS, **USAGE_DELIBERATE, "body.choices[0].message.content": TEXT},
    ),
    Scenario(
        "lora_chat_stream",
        "/v1/chat/completions",
        chat(model="b", stream=True, stream_options={"include_usage": True}),
        kind="sse",
        before=(load("b", "b"),),
        same=(
            "status",
            "content_type",
            "sequence",
            "frames.content.model",
            "frames.usage.usage.completion_tokens",
        ),
        expect={"frames.content.model": "b"},
        deliberate={
            "frames.*.id": RANDOM_ID,
            "frames.content.choices[0].delta.content": TEXT,
            "frames.usage.usage.prompt_tokens": PROMPT_COUNT,
        },
    ),
    Scenario(
        # The adapter named at start.
        "lora_completions",
        "/v1/completions",
        completion(model="a"),
        same=(
            "status",
            "content_type",
            "body.object",
            "body.model",
            "body.choices[0].finish_reason",
            "body.usage.completion_tokens",
            "body.usage.prompt_tokens_details.cached_tokens",
        ),
        expect={"body.model": "a"},
        deliberate={**OPENAI_IDS, **USAGE_DELIBERATE, "body.choices[0].text": TEXT},
    ),
    Scenario(
        "lora_completions_stream",
        "/v1/completions",
        completion(model="a", stream=True, stream_options={"include_usage": True}),
        kind="sse",
        same=(
            "status",
            "content_type",
            "sequence",
            "frames.text.model",
            "frames.usage.usage.completion_tokens",
        ),
        expect={"frames.text.model": "a"},
        deliberate={"frames.text.choices[0].text": TEXT},
    ),
    Scenario(
        "lora_tokenize",
        "/tokenize",
        {"model": "b", "prompt": "the sea"},
        before=(load("b", "b"),),
        same=("status", "content_type", "body.max_model_len"),
        expect={"status": 200},
        deliberate={"body.count": PROMPT_COUNT, "body.tokens": "the simulator's token ids"},
    ),
    Scenario(
        # After a request on an adapter: vllm:lora_requests_info has a sample (max_lora is
        # --max-loras), beside the waiting-by-reason gauges every engine has.
        "lora_metrics_families",
        "/metrics",
        method="GET",
        kind="metrics",
        before=(("/v1/completions", completion(model="a")),),
        same=("families",),
        expect={"families[vllm:lora_requests_info].max_lora": "1"},
    ),
    Scenario(
        # One adapter slot: long streams on a and b and a shorter request on the base, sent
        # at once. Nothing is refused: the adapter that comes second waits (over a second:
        # until the first one's stream is over), the base's request runs beside and ends
        # first. vllm:lora_requests_info stamps the adapter running ("a" or "b": the waiting
        # one is not named, the gauge names an adapter once a request on it is scheduled,
        # under both labels, running and waiting alike), then the other, and "" when all are
        # done; never "a,b".
        "lora_slot_taken",
        "/v1/chat/completions",
        chat(model="a", max_tokens=LONG, stream=True, stream_options={"include_usage": True}),
        kind="lora_slot",
        before=(load("b", "b"),),
        params={"other": "b", "beside": BESIDE},
        # Not compared: how long the other adapter's request waited in vLLM's queue-time
        # histogram. Alone on a quiet machine the real engine counted no wait over 0.3 s
        # (CI4, and by hand, three attempts each) while within the whole set it did: the
        # stamps below ("a", then "b", never "a,b") are what shows the one slot.
        same=("finished_first", "lora_info_stamped", "endings"),
        expect={
            "finished_first": "base",
            "lora_info_stamped": ["", "a", "b"],
            "endings[1].every_token": True,
        },
    ),
    Scenario(
        # Four adapters, two kept read (--max-cpu-loras 2): d holds a's files, e b's. Each is
        # asked twice in turn, so most requests read their adapter again: all answer, the
        # same each time, and the same files answer alike under either name.
        "lora_more_adapters_than_kept_read",
        "/v1/chat/completions",
        chat(max_tokens=8, temperature=0, ignore_eos=False),
        kind="same_files",
        before=(load("b", "b"), load("d", "a"), load("e", "b")),
        params={"adapters": ("a", "b", "d", "e"), "twins": (("d", "a"), ("e", "b"))},
        same=(
            "all_answered",
            "each_answers_the_same_again",
            "twins_answer_alike",
            "others_differ",
        ),
        expect={"all_answered": True, "twins_answer_alike": True, "others_differ": True},
    ),
)
