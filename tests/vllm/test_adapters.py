"""The test adapters on the real vLLM: what per-tenant adapters (issue 29) are built on.

``scripts/make-test-model`` stages LoRA adapters for the test model beside it
(``tollgate-test/tiny-llama-lora-a`` and ``-b``: PEFT's format, rank 8 on ``q_proj`` and
``v_proj``, random matrices from seeds of their own; ``-c`` the same at rank 16, which an
engine with ``--max-lora-rank 8`` refuses). vLLM serves one named at start
(``--lora-modules``) and one loaded at run time (``POST /v1/load_lora_adapter``, allowed by
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), with one adapter slot (``--max-loras 1``), so
alternating requests swap them: the session's ``lora_engine`` (tests/vllm/conftest.py), which
the LoRA fidelity scenarios use too. These are the engine's own answers, shapes and errors that
Tollgate's loading, routing and the simulator follow."""

from __future__ import annotations

import httpx
import pytest

from tests.vllm.conftest import MODEL_VOLUME, SERVED_NAME, TEST_MODEL, RealEngine
from tests.vllm.test_engine_image import run_in_image

pytestmark = pytest.mark.vllm

# Each adapter's identity (the maker prints it): one SHA-256 over its files' names and bytes.
ADAPTER_DIGESTS = {
    "a": "baf7d8ca2c221e13d8917fe1869754579e67369584bfefab4c55f17453f83ff6",
    "b": "940c13fbeb7cc74e795eca08c99aabac3fa24963dd4f1a808fd9f69f51d9045d",
    "c": "c43926de90ac416320afee00749f4efffda6dfe0c334c1f2667598a0b63dcd2a",
}
MAKER = "/opt/tollgate/testmodel/make_test_model.py"


def repo(name: str) -> str:
    return f"{TEST_MODEL}-lora-{name}"


def greedy(engine: RealEngine, model: str) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    return httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=60)


def text(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def admin(engine: RealEngine, action: str, **body: str) -> httpx.Response:
    return httpx.post(f"{engine.url}/v1/{action}_lora_adapter", json=body, timeout=60)


def test_the_test_adapters_are_the_same_bytes_on_every_machine() -> None:
    """Each adapter made from nothing has its recorded digest, and the stage's model cache
    holds that revision under the adapter's repository id."""
    for name, want in ADAPTER_DIGESTS.items():
        made = run_in_image("sh", "-c", f"python3 {MAKER} --folder /tmp/a --adapter {name}")
        assert made.split()[-1] == want
        refs = run_in_image(
            "cat",
            f"/root/.cache/huggingface/hub/models--{repo(name).replace('/', '--')}/refs/main",
            volume=MODEL_VOLUME,
        )
        assert refs == want[:40]


def test_base_and_two_adapters_answer_differently(lora_engine: RealEngine) -> None:
    """The base, the adapter named at start and one loaded at run time: three different
    greedy answers, each the same when asked again after the others (one adapter slot:
    the engine swaps them)."""
    cards = httpx.get(f"{lora_engine.url}/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (SERVED_NAME, None, TEST_MODEL),
        ("a", SERVED_NAME, repo("a")),
    ]
    loaded = admin(lora_engine, "load", lora_name="b", lora_path=repo("b"))
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'b' added successfully."
    assert "content-type" not in loaded.headers  # a bare text body
    counted = httpx.post(
        f"{lora_engine.url}/tokenize", json={"model": "b", "prompt": "the sea"}, timeout=10
    )
    assert counted.status_code == 200, counted.text
    first = {model: text(greedy(lora_engine, model)) for model in (SERVED_NAME, "a", "b")}
    assert len(set(first.values())) == 3, first
    again = {model: text(greedy(lora_engine, model)) for model in ("b", "a", SERVED_NAME)}
    assert again == first


def test_adapter_errors_as_vllm_words_them(lora_engine: RealEngine) -> None:
    """Loading a loaded name, unloading an unknown one, a path with no adapter, and asking
    for an adapter that was unloaded: the errors Tollgate's worker and gateway meet."""
    admin(lora_engine, "load", lora_name="b", lora_path=repo("b"))  # loaded or not before
    twice = admin(lora_engine, "load", lora_name="b", lora_path=repo("b"))
    assert twice.status_code == 400
    assert twice.json()["error"] == {
        "message": "The lora adapter 'b' has already been loaded. If you want to load the "
        "adapter in place, set 'load_inplace' to True.",
        "type": "InvalidUserInput",
        "param": None,
        "code": 400,
    }
    missing = admin(lora_engine, "load", lora_name="c", lora_path="/nonexistent")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError"
    assert "No adapter found for /nonexistent" in missing.json()["error"]["message"]
    gone = admin(lora_engine, "unload", lora_name="b")
    assert (gone.status_code, gone.text) == (
        200,
        "Success: LoRA adapter 'b' removed successfully.",
    )
    again = admin(lora_engine, "unload", lora_name="b")
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "The lora adapter 'b' cannot be found."
    asked = greedy(lora_engine, "b")
    assert asked.status_code == 404
    assert asked.json()["error"]["message"] == (
        f"The model `b` does not exist. Valid aliases: {SERVED_NAME}."
    )
