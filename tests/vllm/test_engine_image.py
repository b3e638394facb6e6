"""The CPU engine image and the test model: what an admin trying Tollgate without a GPU
gets from ``scripts/build-images vllm-cpu`` and ``scripts/make-test-model``."""

from __future__ import annotations

from collections.abc import Callable

import docker
import httpx
import pytest

from deployments.abort_check import CHECK_TOKENS, engine_drops_abandoned
from tests import leaks
from tests.vllm.conftest import MODEL_VOLUME, TEST_MODEL, VLLM_IMAGE, RealEngine

pytestmark = pytest.mark.vllm

# The model's identity: one SHA-256 over its files' names and bytes. Every machine makes
# these same bytes from compose/vllm-cpu/testmodel/ (the maker prints it; a deliberate
# change to the model changes it here too).
MODEL_DIGEST = "99e3471f35350b9428b74eff1d676059c503d6b8f80e8f63219eb217aa8767b0"


def run_in_image(*command: str, volume: str | None = None) -> str:
    client = docker.from_env()
    volumes = {volume: {"bind": "/root/.cache/huggingface", "mode": "rw"}} if volume else {}
    # Detached, then waited for: run(remove=True) can lose the output of a quick command.
    container = client.containers.run(
        VLLM_IMAGE,
        list(command[1:]),
        entrypoint=[command[0]],
        network_mode="none",
        labels={"tollgate.test": leaks.RUN},
        volumes=volumes,
        detach=True,
    )
    try:
        status = container.wait(timeout=300)["StatusCode"]
        out = container.logs(stdout=True, stderr=False).decode().strip()
        assert status == 0, f"{command} exited with {status}: {out}"
        return out
    finally:
        container.remove(force=True)


def test_the_test_model_is_the_same_bytes_on_every_machine() -> None:
    """Made twice from nothing, the model has the recorded digest both times, and the staged
    copy in the stage's model cache is the same revision."""
    first = run_in_image(
        "sh", "-c", "python3 /opt/tollgate/testmodel/make_test_model.py --folder /tmp/m"
    )
    second = run_in_image(
        "sh", "-c", "python3 /opt/tollgate/testmodel/make_test_model.py --folder /tmp/m"
    )
    assert first.split()[-1] == second.split()[-1] == MODEL_DIGEST
    refs = run_in_image(
        "cat",
        f"/root/.cache/huggingface/hub/models--{TEST_MODEL.replace('/', '--')}/refs/main",
        volume=MODEL_VOLUME,
    )
    assert refs == MODEL_DIGEST[:40]


def test_vllm_command_is_the_official_images_entrypoint() -> None:
    """``vllm serve`` works as in vllm/vllm-openai (the package is named vllm-cpu) and the
    CPU build reports itself as such."""
    client = docker.from_env()
    image = client.images.get(VLLM_IMAGE)
    assert image.attrs["Config"]["Entrypoint"] == ["vllm", "serve"]
    version = run_in_image("vllm", "--version")
    assert version == "0.32.0+cpu"


def test_engine_serves_the_test_model_with_vllms_own_metrics(shared_engine: RealEngine) -> None:
    """A chat answer with usage, and the /metrics families Tollgate reads, under their real
    names; the counters move by exactly the usage the engine reported."""
    engine = shared_engine
    cards = httpx.get(f"{engine.url}/v1/models", timeout=10).json()["data"]
    assert [card["id"] for card in cards] == ["tiny-llama"]
    assert cards[0]["max_model_len"] == 2048
    before = (
        engine.metric("vllm:prompt_tokens_total"),
        engine.metric("vllm:generation_tokens_total"),
    )
    answer = httpx.post(
        f"{engine.url}/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 12,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    usage = answer["usage"]
    assert usage["completion_tokens"] == 12
    assert answer["choices"][0]["finish_reason"] == "length"
    after = engine.metric("vllm:prompt_tokens_total"), engine.metric("vllm:generation_tokens_total")
    assert (after[0] - before[0], after[1] - before[1]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    for family in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info",
    ):
        assert f"\n{family}{{" in text, family


def test_vllm_drops_a_request_whose_client_left(shared_engine: RealEngine) -> None:
    """What makes the gateway's preemption free a slot: asked on the idle engine
    (deployments/abort_check.py, as the controller asks before any preemption), vLLM drops
    the streamed request once its client hangs up, long before its CHECK_TOKENS."""
    engine = shared_engine
    before = engine.metric("vllm:generation_tokens_total")
    assert engine_drops_abandoned(engine.url, "tiny-llama") is True
    assert engine.metric("vllm:num_requests_running") == 0
    assert engine.metric("vllm:generation_tokens_total") - before < CHECK_TOKENS


def test_a_second_start_loads_the_compile_cache(
    shared_engine: RealEngine, vllm_factory: Callable[..., RealEngine]
) -> None:
    """An engine started again with the same flags loads the kernels the first start saved
    in the compile cache volume instead of compiling them again (vLLM 0.32's CPU build
    failed to, every time, until the image patched it: compose/vllm-cpu/patch_aot_load.py),
    and the loaded model answers exactly as the one that compiled them."""
    from tests.vllm.fidelity_scenarios import ENGINE_FLAGS

    again = vllm_factory(*ENGINE_FLAGS[2:])
    log = again.container.logs().decode(errors="replace")
    assert "Compiling model again" not in log, log[-3000:]
    assert "Directly load AOT compilation" in log, log[-3000:]
    for prompt in ("Hello there", "Tell me a story about tokens"):
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        first, second = (
            httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60).json()
            for engine in (shared_engine, again)
        )
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert second["usage"] == first["usage"]
