"""The simulator image builds here without a registry and starts like vllm/vllm-openai."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import docker
import httpx
import pytest

from tests import leaks
from tests.engine_sim.conftest import ROOT, wait_until

IMAGE = "tollgate/engine-sim:latest"


@pytest.fixture
def container() -> Iterator[object]:
    subprocess.run([str(ROOT / "scripts" / "build-images"), "engine-sim"], check=True, timeout=900)
    client = docker.from_env()
    c = client.containers.run(
        IMAGE,
        [
            "Qwen/Qwen3-8B",
            "--served-model-name",
            "qwen3-8b",
            "--max-model-len",
            "8k",
            "--tensor-parallel-size",
            "2",
            "--distributed-executor-backend",
            "ray",
            "--sim-load-seconds",
            "0.5",
        ],
        ports={"8000/tcp": ("127.0.0.1", None)},
        labels={"tollgate.test": leaks.RUN},
        detach=True,
    )
    try:
        yield c
    finally:
        c.remove(force=True)


def published_url(c) -> str:
    c.reload()
    binding = c.attrs["NetworkSettings"]["Ports"]["8000/tcp"][0]
    return f"http://127.0.0.1:{binding['HostPort']}"


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.docker
def test_image_answers_health_and_models(container):
    url = published_url(container)
    wait_until(lambda: healthy(url), timeout=30, what="/health 200 from the container")
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["qwen3-8b"]
    assert models["data"][0]["max_model_len"] == 8000
    # The agent-era APIs are in the image too.
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3
    r = httpx.post(
        url + "/v1/messages",
        timeout=30,
        json={
            "model": "qwen3-8b",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3
    logs = container.logs().decode()
    assert "Loading safetensors checkpoint shards: 100% Completed" in logs
    assert container.attrs["Config"]["User"] == "sim"
