"""LoRA adapters on the simulator, as vLLM 0.32 serves them (tests/vllm/test_adapters.py holds
the real engine to the same answers): named at start, loaded and unloaded at run time from a
folder or the Hugging Face cache, each answering its own way, errors word for word."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.engine_sim.conftest import Sim

BASE = "tiny"


def adapter_folder(root: Path, name: str, rank: int = 8) -> Path:
    """What PEFT writes (the simulator reads only the config's rank)."""
    folder = root / name
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "target_modules": ["q_proj", "v_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return folder


def hub_adapter(hf_home: Path, repo: str, rank: int = 8) -> None:
    """An adapter staged in the hub cache's layout, as a download (or Tollgate) leaves it."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    adapter_folder(root / "snapshots", "0123abcd", rank)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0123abcd")


@pytest.fixture
def lora_sim(start_sim, tmp_path: Path) -> Sim:
    hf_home = tmp_path / "hf"
    hub_adapter(hf_home, "acme/support-lora")
    hub_adapter(hf_home, "acme/wide-lora", rank=16)
    named = adapter_folder(tmp_path, "named")
    return start_sim(
        "some/base-model",
        "--served-model-name",
        BASE,
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"a={named}",
        "--enable-prompt-tokens-details",
        "--sim-output-tokens-min",
        "12",
        "--sim-output-tokens-max",
        "12",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HOME": str(hf_home)},
    )


def ask(sim: Sim, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    return httpx.post(f"{sim.url}/v1/chat/completions", json=body, timeout=10)


def text(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def admin(sim: Sim, action: str, **body: str) -> httpx.Response:
    return httpx.post(f"{sim.url}/v1/{action}_lora_adapter", json=body, timeout=10)


def test_adapters_are_cards_and_answer_their_own_way(lora_sim: Sim, tmp_path: Path) -> None:
    cards = httpx.get(f"{lora_sim.url}/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["root"], c["max_model_len"]) for c in cards] == [
        (BASE, None, "some/base-model", cards[0]["max_model_len"]),
        ("a", BASE, str(tmp_path / "named"), None),
    ]
    loaded = admin(lora_sim, "load", lora_name="b", lora_path="acme/support-lora")
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'b' added successfully.",
    )
    assert "content-type" not in loaded.headers  # a bare text body, as vLLM's
    assert [c["id"] for c in httpx.get(f"{lora_sim.url}/v1/models").json()["data"]] == [
        BASE,
        "a",
        "b",
    ]
    first = {model: text(ask(lora_sim, model)) for model in (BASE, "a", "b")}
    assert len(set(first.values())) == 3, first
    assert {model: text(ask(lora_sim, model)) for model in ("b", "a", BASE)} == first
    assert ask(lora_sim, "b").json()["model"] == "b"


def test_adapter_errors_as_vllm_words_them(lora_sim: Sim) -> None:
    twice = admin(lora_sim, "load", lora_name="a", lora_path="acme/support-lora")
    assert twice.status_code == 400
    assert twice.json()["error"] == {
        "message": "The lora adapter 'a' has already been loaded. If you want to load the "
        "adapter in place, set 'load_inplace' to True.",
        "type": "InvalidUserInput",
        "param": None,
        "code": 400,
    }
    missing = admin(lora_sim, "load", lora_name="c", lora_path="/nonexistent")
    assert (missing.status_code, missing.json()["error"]["message"]) == (
        404,
        "Loading lora c failed: No adapter found for /nonexistent",
    )
    wide = admin(lora_sim, "load", lora_name="w", lora_path="acme/wide-lora")
    assert wide.status_code == 500
    assert wide.json()["error"]["message"] == (
        "Call to add_lora method failed: Worker failed with error 'LoRA rank 16 is greater "
        "than max_lora_rank 8.', please check the stack trace above for the root cause"
    )
    no_path = admin(lora_sim, "load", lora_name="c")
    assert no_path.status_code == 400
    assert no_path.json()["error"]["param"] == "body.lora_path"
    gone = admin(lora_sim, "unload", lora_name="a")
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'a' removed successfully.")
    again = admin(lora_sim, "unload", lora_name="a")
    assert (again.status_code, again.json()["error"]["message"]) == (
        404,
        "The lora adapter 'a' cannot be found.",
    )
    asked = ask(lora_sim, "a")
    assert (asked.status_code, asked.json()["error"]["message"]) == (
        404,
        f"The model `a` does not exist. Valid aliases: {BASE}.",
    )


def test_an_adapters_prefix_cache_is_its_own(lora_sim: Sim) -> None:
    """The same long prompt through the base then the adapter: nothing of the base's cached
    blocks serves the adapter (vLLM keys cached blocks with the LoRA too)."""
    body = {"messages": [{"role": "user", "content": "the sea " * 200}], "max_tokens": 1}
    usage = {}
    for model in (BASE, "a", "a"):
        got = httpx.post(f"{lora_sim.url}/v1/chat/completions", json={**body, "model": model})
        assert got.status_code == 200, got.text
        usage.setdefault(model, []).append(got.json()["usage"])
    cached = {
        m: [u["prompt_tokens_details"]["cached_tokens"] for u in got] for m, got in usage.items()
    }
    assert cached[BASE] == [0]
    assert cached["a"][0] == 0  # the base's blocks are not the adapter's
    assert cached["a"][1] > 0  # its own are


def test_without_runtime_updating_there_are_no_routes(start_sim, tmp_path: Path) -> None:
    sim = start_sim("--enable-lora", "--lora-modules", f"a={adapter_folder(tmp_path, 'x')}")
    answer = admin(sim, "load", lora_name="b", lora_path=str(tmp_path / "x"))
    assert (answer.status_code, answer.json()) == (404, {"detail": "Not Found"})
