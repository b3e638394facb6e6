"""Adapters in the catalogue: names, the check of their files, which ones a replica unloads."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from core.errors import Conflict
from core.keyspace import lora_keys
from core.redis import get_redis
from deployments import adapter_loading, services
from deployments.adapters import INSPECT_SCRIPT, create_adapter, judge
from deployments.choices import AdapterStatus
from deployments.models import CatalogModel, Deployment, Node

pytestmark = pytest.mark.django_db


@pytest.fixture
def base() -> CatalogModel:
    return services.create_model(
        None,
        served_name="base",
        source="org/base",
        params_billions=Decimal("1"),
        context_length=4096,
    )


def lora_deployment(base: CatalogModel, **args: object) -> Deployment:
    node = Node.objects.create(name="n1", docker_url="unix:///x", queue="node.n1")
    return Deployment.objects.create(
        name="d",
        model=base,
        node=node,
        image="tollgate/engine-sim:latest",
        engine_args={"enable-lora": True, **args},
    )


def test_an_adapter_cannot_take_a_models_name(base: CatalogModel) -> None:
    with pytest.raises(Conflict):
        create_adapter(None, served_name="base", base=base, source="org/lora")


def test_without_a_deployment_serving_adapters_it_waits_to_be_checked(base: CatalogModel) -> None:
    adapter = create_adapter(None, served_name="acme/a", base=base, source="org/lora")
    adapter.refresh_from_db()
    assert adapter.status == AdapterStatus.CHECKING
    assert "Waiting for a deployment of base with adapters enabled" in adapter.status_message
    assert not adapter.operations.exists()
    lora_deployment(base)
    adapter = create_adapter(None, served_name="acme/b", base=base, source="org/lora")
    assert adapter.operations.get().detail["image"] == "tollgate/engine-sim:latest"


REPORT = {
    "files": ["adapter_config.json", "adapter_model.safetensors", "README.md"],
    "size_bytes": 1000,
    "peft_type": "LORA",
    "rank": 8,
    "target_modules": ["q_proj", "v_proj"],
    "missing_modules": [],
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({}, None),
        ({"files": ["adapter_config.json", "adapter_model.bin"]}, "Only safetensors weights"),
        ({"files": ["adapter_config.json"]}, "No adapter weights"),
        ({"files": [*REPORT["files"], "handler.py"]}, "found handler.py"),
        ({"peft_type": "IA3"}, "only LoRA adapters are served"),
        ({"rank": 32}, "rank 32 is above the largest --max-lora-rank (16)"),
        ({"rank": None}, "gives no rank"),
        ({"missing_modules": ["gate_proj"]}, "base has no module(s) gate_proj"),
        ({"size_bytes": 3 * 1024**3}, "the limit is"),
        ({"error": "No adapter found at x"}, "No adapter found at x"),
    ],
)
def test_judge_names_what_is_wrong(base: CatalogModel, change: dict, message: str | None) -> None:
    lora_deployment(base, **{"max-lora-rank": 16})
    errors = judge({**REPORT, **change}, base)
    if message is None:
        assert errors == []
    else:
        assert any(message in e for e in errors), errors


def safetensors(path: Path, names: list[str]) -> None:
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for n in names})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 4)


def test_the_inspection_reads_the_config_and_the_bases_modules(tmp_path: Path) -> None:
    adapter, model = tmp_path / "adapter", tmp_path / "model"
    adapter.mkdir()
    model.mkdir()
    config = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "gate_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    safetensors(adapter / "adapter_model.safetensors", ["x.lora_A.weight"])
    safetensors(
        model / "model.safetensors",
        [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ],
    )
    run = subprocess.run(
        [sys.executable, "-c", INSPECT_SCRIPT, str(adapter), str(model)],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(run.stdout)
    assert report["rank"] == 8 and report["peft_type"] == "LORA"
    assert report["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert report["missing_modules"] == ["gate_proj"]
    missing = subprocess.run(
        [sys.executable, "-c", INSPECT_SCRIPT, str(tmp_path / "nope"), str(model)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "No adapter found" in json.loads(missing.stdout)["error"]


def test_the_least_recently_used_adapter_goes_first_and_a_busy_one_last() -> None:
    r = get_redis()
    held, used, _ = lora_keys(7)
    now = adapter_loading.time.time() * 1000
    r.zadd(used, {"1": now - 60_000, "2": now - 500, "3": now - 30_000})
    loaded = {1: "a", 2: "b", 3: "c"}
    assert adapter_loading._victims(7, loaded, 2) == [1]
    assert adapter_loading._victims(7, loaded, 0) == [1, 3, 2]
    assert adapter_loading._victims(7, loaded, 3) == []
    assert adapter_loading._victims(7, {**loaded, 4: "never used"}, 3) == [4]
