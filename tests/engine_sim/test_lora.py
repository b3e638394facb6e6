"""LoRA adapters on the simulator, as vLLM 0.32 serves them (tests/vllm/fidelity_scenarios.py
holds it to the real engine): named at start, loaded and unloaded at run time from a folder or
the Hugging Face cache, each answering its own way, errors word for word; --max-loras
different adapters at once (a request on another waits), --max-cpu-loras kept read (others
read again when used, and the engine dies when their files are gone)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.engine_sim.conftest import Sim, wait_until

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
    for body, message in (
        ({"lora_name": "", "lora_path": "x"}, "Both 'lora_name' and 'lora_path' must be provided."),
        (
            {"lora_name": BASE, "lora_path": "acme/support-lora"},
            f"The lora adapter '{BASE}' conflicts with a served base model.",
        ),
    ):
        refused = admin(lora_sim, "load", **body)
        assert (refused.status_code, refused.json()["error"]["type"]) == (400, "InvalidUserInput")
        assert refused.json()["error"]["message"] == message
    nameless = admin(lora_sim, "unload", lora_name="")
    assert (nameless.status_code, nameless.json()["error"]["message"]) == (
        400,
        "'lora_name' needs to be provided to unload a LoRA adapter.",
    )
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


# --- the LoRA budget (--max-loras) and the worker's cache (--max-cpu-loras) -----------------


@pytest.fixture
def slots_sim(start_sim, tmp_path: Path) -> Sim:
    """One adapter slot, two adapters kept read; 100 tokens/s, so a 200-token reply runs 2 s."""
    hf_home = tmp_path / "hf"
    for repo in ("acme/sea-lora", "acme/sky-lora", "acme/sun-lora"):
        hub_adapter(hf_home, repo)
    return start_sim(
        "some/base-model",
        "--served-model-name",
        BASE,
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "2",
        "--lora-modules",
        "sea=acme/sea-lora",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-decode-tps",
        "100",
        "--sim-crash-grace-seconds",
        "0.5",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HOME": str(hf_home)},
    )


def background(fn: Callable[[], httpx.Response]) -> Future:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def long_reply(sim: Sim, model: str, tokens: int = 200) -> Callable[[], httpx.Response]:
    body = {"model": model, "prompt": "the sea", "max_tokens": tokens, "ignore_eos": True}
    return lambda: httpx.post(f"{sim.url}/v1/completions", json=body, timeout=30)


def lora_info(sim: Sim) -> list[str]:
    """The vllm:lora_requests_info samples, newest first."""
    lines = [
        line
        for line in httpx.get(f"{sim.url}/metrics").text.splitlines()
        if line.startswith("vllm:lora_requests_info{")
    ]
    return sorted(lines, key=lambda line: float(line.rsplit(" ", 1)[1]), reverse=True)


def test_a_second_adapter_waits_for_the_slot_and_the_base_does_not(slots_sim: Sim) -> None:
    """One slot: while sea's reply runs, sky's request waits (vLLM defers it: its LoRA
    budget), the base's is answered at once; sky's runs when sea's is done."""
    assert admin(slots_sim, "load", lora_name="sky", lora_path="acme/sky-lora").status_code == 200
    sea = background(long_reply(slots_sim, "sea"))
    wait_until(lambda: slots_sim.metric("vllm:num_requests_running") == 1, what="sea to run")
    sky = background(long_reply(slots_sim, "sky", 2))
    wait_until(
        lambda: slots_sim.metric("vllm:num_requests_waiting_by_reason", 'reason="deferred"'),
        what="sky to be deferred",
    )
    assert slots_sim.metric("vllm:num_requests_waiting") == 1
    assert lora_info(slots_sim)[0].startswith(
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="sea",'
        'waiting_lora_adapters="sea"}'
    )
    base = long_reply(slots_sim, BASE, 2)()
    assert base.status_code == 200
    assert not sea.done() and not sky.done()
    assert sky.result().status_code == 200
    assert sea.done() and sea.result().status_code == 200
    assert slots_sim.metric("vllm:num_requests_waiting_by_reason", 'reason="deferred"') == 0
    assert 'running_lora_adapters=""' in lora_info(slots_sim)[0]


def test_unloading_does_not_stop_requests_already_sent(slots_sim: Sim) -> None:
    """vLLM's unload only takes the name out of the server's table: a reply running on the
    adapter, and one waiting for the slot, both end as they would have."""
    assert admin(slots_sim, "load", lora_name="sky", lora_path="acme/sky-lora").status_code == 200
    sea = background(long_reply(slots_sim, "sea"))
    wait_until(lambda: slots_sim.metric("vllm:num_requests_running") == 1, what="sea to run")
    sky = background(long_reply(slots_sim, "sky", 5))
    wait_until(lambda: slots_sim.metric("vllm:num_requests_waiting") == 1, what="sky to wait")
    for name in ("sea", "sky"):
        assert admin(slots_sim, "unload", lora_name=name).status_code == 200
    assert ask(slots_sim, "sea").status_code == 404
    assert not sea.done()
    assert sea.result().json()["usage"]["completion_tokens"] == 200
    assert sky.result().json()["usage"]["completion_tokens"] == 5


def test_adapters_beyond_the_cpu_cache_still_answer(slots_sim: Sim) -> None:
    """Four adapters, two kept read: each still answers (read again when used), and the
    same files under another name answer alike."""
    for name, repo in (
        ("sky", "acme/sky-lora"),
        ("sun", "acme/sun-lora"),
        ("sea2", "acme/sea-lora"),
    ):
        assert admin(slots_sim, "load", lora_name=name, lora_path=repo).status_code == 200
    first = {name: text(ask(slots_sim, name)) for name in ("sea", "sky", "sun", "sea2")}
    assert first["sea2"] == first["sea"]
    assert len({first["sea"], first["sky"], first["sun"]}) == 3
    assert {name: text(ask(slots_sim, name)) for name in first} == first


def test_an_adapter_read_again_from_files_that_are_gone_kills_the_engine(
    slots_sim: Sim, tmp_path: Path
) -> None:
    """As with vLLM: an adapter pushed out of the worker's cache is read again when a request
    uses it; with its folder deleted the engine dies (500 now, then /health 503 and exit)."""
    folder = adapter_folder(tmp_path, "doomed")
    assert admin(slots_sim, "load", lora_name="doomed", lora_path=str(folder)).status_code == 200
    assert ask(slots_sim, "doomed").status_code == 200
    shutil.rmtree(folder)
    assert ask(slots_sim, "doomed").status_code == 200  # still in the cache: not read again
    for name, repo in (("sky", "acme/sky-lora"), ("sun", "acme/sun-lora")):
        assert admin(slots_sim, "load", lora_name=name, lora_path=repo).status_code == 200
    died = ask(slots_sim, "doomed")
    assert died.status_code == 500
    assert died.json()["error"]["message"] == (
        "EngineCore encountered an issue. See stack trace (above) for the root cause."
    )
    assert httpx.get(f"{slots_sim.url}/health").status_code == 503
    deadline = time.monotonic() + 10
    while slots_sim.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slots_sim.proc.poll() == 1


def test_lora_settings_vllm_refuses_at_start(start_sim, tmp_path: Path) -> None:
    for args, said in (
        (
            ("--max-loras", "2", "--max-cpu-loras", "1"),
            "ValueError: max_cpu_loras (1) must be >= max_loras (2).",
        ),
        (
            ("--lora-modules", "a=/nonexistent"),
            "ValueError: Loading lora a failed: No adapter found for /nonexistent",
        ),
    ):
        sim = start_sim("--enable-lora", *args, "--sim-load-seconds", "0", wait=False)
        assert sim.proc.wait(timeout=10) == 1
        assert said in sim.output()


def test_reading_an_adapter_takes_the_load_time(start_sim, tmp_path: Path) -> None:
    """--sim-lora-load-ms: a runtime load answers after that long, and a request on an adapter
    pushed out of --max-cpu-loras waits that long again (it is read anew); one on an adapter
    still read does not."""
    hf_home = tmp_path / "hf"
    for repo in ("acme/sea-lora", "acme/sky-lora", "acme/sun-lora"):
        hub_adapter(hf_home, repo)
    sim = start_sim(
        "some/base-model",
        "--served-model-name",
        BASE,
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-cpu-loras",
        "2",
        "--lora-modules",
        "sea=acme/sea-lora",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-decode-tps",
        "0",
        "--sim-lora-load-ms",
        "1000",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HOME": str(hf_home)},
    )

    def seconds(call: Callable[[], httpx.Response]) -> float:
        started = time.monotonic()
        answer = call()
        assert answer.status_code == 200, answer.text
        return time.monotonic() - started

    assert seconds(lambda: admin(sim, "load", lora_name="sky", lora_path="acme/sky-lora")) >= 1
    assert seconds(lambda: ask(sim, "sky")) < 1  # read by the load
    assert seconds(lambda: ask(sim, "sea")) < 1  # read at start
    # A third adapter pushes the least recently used (sky) out of the two kept read.
    assert seconds(lambda: admin(sim, "load", lora_name="sun", lora_path="acme/sun-lora")) >= 1
    assert seconds(lambda: ask(sim, "sky")) >= 1
    assert seconds(lambda: ask(sim, "sky")) < 1
