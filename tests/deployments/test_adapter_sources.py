"""Where an adapter's files come from: a hub id is downloaded into each serving node's model
cache when its check finds it missing, an upload is copied there through Docker's archive
API, and the adapter is ready once every node's check passed.

The docker-marked tests run the check task in this process, as a node's worker would, on the
local Docker Engine behind the Docker API policy (the ``stack`` fixture fails on any call it
refuses) with the stack's own model cache volume."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from deployments import adapter_uploads, adapters, relay, services, tasks
from deployments.adapter_files import UPLOADS, archive_path, upload_folder
from deployments.choices import AdapterStatus, OperationKind, OperationStatus
from deployments.models import Adapter, CatalogModel, Deployment, Node, Operation, Replica
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.deployments.conftest import SIM_IMAGE
from tests.deployments.test_adapter_archives import GOOD, make_tar
from tests.deployments.test_docker import containers
from tests.scaleout.agents import agent_thread

REPORT = {
    "files": ["adapter_config.json", "adapter_model.safetensors"],
    "size_bytes": 1000,
    "peft_type": "LORA",
    "rank": 8,
    "target_modules": ["q_proj"],
    "missing_modules": [],
}


def lora_deployment(model: CatalogModel, node: Node, name: str = "tiny") -> Deployment:
    return Deployment.objects.create(
        name=name,
        model=model,
        node=node,
        image=SIM_IMAGE,
        engine_args={"enable-lora": True, "max-lora-rank": 16, "max-num-seqs": 4},
    )


def acme() -> Tenant:
    return tenant_services.create_tenant(None, name="Acme Research", slug="acme")


@pytest.fixture
def base(db: None) -> CatalogModel:
    return services.create_model(
        None,
        served_name="tiny-chat",
        source="Qwen/Qwen3-0.6B",
        params_billions=Decimal("0.6"),
        context_length=4096,
    )


def node(name: str) -> Node:
    return Node.objects.create(name=name, docker_url="unix:///x", queue=f"node.{name}")


# --- Every serving node checks (and gets) the files ------------------------------------------


def test_each_node_serving_the_base_with_adapters_checks_the_files(base: CatalogModel) -> None:
    one, two = node("n1"), node("n2")
    spread = lora_deployment(base, one)
    Replica.objects.create(deployment=spread, index=1, node=two)
    lora_deployment(base, two, name="second")  # a node already counted is checked once
    adapter = adapters.create_adapter(
        None, served_name="acme-x", base=base, source="org/x-lora", tenant=None
    )
    ops = list(adapter.operations.order_by("node__name"))
    assert [(op.kind, op.node.name) for op in ops] == [
        (OperationKind.CHECK_ADAPTER, "n1"),
        (OperationKind.CHECK_ADAPTER, "n2"),
    ]
    assert len({op.detail["round"] for op in ops}) == 1


def settle(op: Operation, errors: list[str]) -> str:
    """A node's check ends with ``errors`` (as check_adapter's end, then the operation's)."""
    Operation.objects.filter(pk=op.pk).update(status=OperationStatus.RUNNING)
    op.refresh_from_db()
    status = adapters._settle(op, op.adapter, errors, {"rank": 8})
    ended = OperationStatus.FAILED if errors else OperationStatus.SUCCEEDED
    Operation.objects.filter(pk=op.pk).update(status=ended)
    return status


def test_the_adapter_is_ready_once_every_node_passed_and_failed_if_one_failed(
    base: CatalogModel,
) -> None:
    lora_deployment(base, node("n1"))
    lora_deployment(base, node("n2"), name="other")
    adapter = adapters.create_adapter(None, served_name="x", base=base, source="org/x-lora")
    first, second = adapter.operations.order_by("node__name")
    assert settle(first, []) == AdapterStatus.CHECKING
    adapter.refresh_from_db()
    assert adapter.status_message == "Checked on n1; waiting for n2."
    assert settle(second, []) == AdapterStatus.READY
    adapter.refresh_from_db()
    assert (adapter.status, adapter.status_message, adapter.rank) == ("ready", "", 8)

    adapters.check_again(None, adapter)
    third, fourth = adapter.operations.filter(status="queued").order_by("node__name")
    air_gapped = "Could not download org/x-lora on n2 (exit code 1): network unreachable"
    assert settle(fourth, [air_gapped]) == AdapterStatus.FAILED
    assert settle(third, []) == AdapterStatus.FAILED  # one node without the files is enough
    adapter.refresh_from_db()
    assert adapter.status_message == air_gapped


def test_a_node_that_joins_later_gets_the_files_of_ready_adapters(base: CatalogModel) -> None:
    first = lora_deployment(base, node("n1"))
    adapter = adapters.create_adapter(None, served_name="x", base=base, source="org/x-lora")
    settle(adapter.operations.get(), [])
    folder = adapters.create_adapter(
        None, served_name="y", base=base, source="/root/.cache/huggingface/y"
    )
    settle(folder.operations.get(), [])
    adapters.check_waiting_adapters(first)  # nothing new: n1 has them
    assert Operation.objects.filter(status="queued").count() == 0
    later = lora_deployment(base, node("n9"), name="later")
    adapters.check_waiting_adapters(later)
    # The hub id is fetched onto n9 in the same round; a folder is the admin's to put there.
    (queued,) = Operation.objects.filter(status="queued")
    assert (queued.adapter, queued.node.name) == (adapter, "n9")
    assert queued.detail["round"] == adapter.operations.last().detail["round"]
    adapter.refresh_from_db()
    assert adapter.status == AdapterStatus.READY  # still served by n1 meanwhile


def test_a_superseded_check_does_not_decide(base: CatalogModel) -> None:
    lora_deployment(base, node("n1"))
    adapter = adapters.create_adapter(None, served_name="x", base=base, source="org/x-lora")
    old = adapter.operations.get()
    adapters.update_adapter(None, adapter, source="org/x-lora-v2")
    assert settle(old, []) == AdapterStatus.CHECKING
    adapter.refresh_from_db()
    assert adapter.status == AdapterStatus.CHECKING


def test_judge_is_unchanged_for_folder_sources(base: CatalogModel) -> None:
    lora_deployment(base, node("n1"))
    assert adapters.judge(REPORT, base) == []
    assert adapters.judge({**REPORT, "rank": 64}, base) == [
        "Its rank 64 is above the largest --max-lora-rank (16) of the deployments of tiny-chat."
    ]


# --- On a real Docker Engine ----------------------------------------------------------------


@pytest.fixture
def uploads(settings: Any, tmp_path: Path) -> Path:
    settings.TOLLGATE_UPLOAD_DIR = str(tmp_path)
    return tmp_path


def run_check(adapter: Adapter) -> Operation:
    op = adapter.operations.get(kind=OperationKind.CHECK_ADAPTER)
    tasks.check_adapter(op.pk)
    op.refresh_from_db()
    return op


@pytest.mark.docker
def test_an_uploaded_adapter_is_copied_into_the_nodes_cache_and_passes_its_check(
    docker_node: Node, sim_model: CatalogModel, stack: str, uploads: Path
) -> None:
    lora_deployment(sim_model, docker_node)
    files = make_tar(GOOD, compress=True)
    adapter = adapter_uploads.create_uploaded_adapter(
        None,
        SimpleUploadedFile("support.tar.gz", files),
        served_name="acme/support",
        base=sim_model,
        tenant=acme(),
    )
    assert archive_path(upload_folder(adapter.source)).is_file()
    op = run_check(adapter)
    assert op.status == OperationStatus.SUCCEEDED, op.error
    adapter.refresh_from_db()
    assert adapter.status == AdapterStatus.READY, adapter.status_message
    assert (adapter.rank, adapter.target_modules) == (8, ["q_proj"])
    assert adapter.size_bytes == sum(len(data) for data in GOOD.values())
    assert adapter.source.startswith(f"{UPLOADS}/acme--support-")
    assert containers(stack) == []  # the copy and check helpers are removed

    # Checked again, the files are found in the cache: no second copy is needed.
    adapters.check_again(None, adapter)
    again = adapter.operations.filter(status="queued").get()
    tasks.check_adapter(again.pk)
    again.refresh_from_db()
    assert again.status == OperationStatus.SUCCEEDED and again.phase == "inspect"


@pytest.mark.docker
def test_an_upload_reaches_a_node_joined_through_its_agent_and_passes_its_check(
    transactional_db: None, sim_model: CatalogModel, stack: str, uploads: Path, settings: Any
) -> None:
    """The archive streams through Redis and the node's agent (a thread here, as the node's
    own Redis user) to that box's Docker API policy, which checks it as it arrives."""
    joined = services.register_node(
        None,
        name=f"j-{stack[-10:]}",
        docker_url=relay.node_url(f"j-{stack[-10:]}"),
        engine_host="127.0.0.1",
        total_memory_bytes=64 * 2**30,
    )
    lora_deployment(sim_model, joined)
    adapter = adapter_uploads.create_uploaded_adapter(
        None,
        SimpleUploadedFile("support.tar.gz", make_tar(GOOD, compress=True)),
        served_name="acme/support",
        base=sim_model,
        tenant=acme(),
    )
    with agent_thread(joined.name, settings.TOLLGATE_DOCKER_URL):
        op = run_check(adapter)
    assert op.status == OperationStatus.SUCCEEDED, op.error
    adapter.refresh_from_db()
    assert adapter.status == AdapterStatus.READY, adapter.status_message
    assert adapter.rank == 8
    assert adapter.size_bytes == sum(len(data) for data in GOOD.values())
    assert containers(stack) == []


# A stand-in for `hf download` in the engine image (no network here): it writes an adapter
# where the hub cache keeps a repo and prints the CLI's progress, or, without the token,
# fails as a download on an air-gapped node does.
FAKE_HF = r"""
import json, os, sys
repo = sys.argv[1]
if os.environ.get("HF_TOKEN") != "hf_test_token":
    sys.exit("OSError: We couldn't connect to 'https://huggingface.co' (the node is offline)")
root = "/root/.cache/huggingface/hub/models--" + repo.replace("/", "--")
snapshot = root + "/snapshots/0123abcd"
os.makedirs(snapshot, exist_ok=True)
os.makedirs(root + "/refs", exist_ok=True)
with open(root + "/refs/main", "w") as fh:
    fh.write("0123abcd")
with open(snapshot + "/adapter_config.json", "w") as fh:
    json.dump({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"]}, fh)
header = json.dumps({"x.lora_A.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
with open(snapshot + "/adapter_model.safetensors", "wb") as fh:
    fh.write(len(header).to_bytes(8, "little") + header.encode() + bytes(4))
print("Fetching 2 files: 100%|##########| 2/2 [00:00<00:00, 20.00it/s]", flush=True)
"""


@pytest.mark.docker
def test_a_hub_id_missing_from_the_cache_is_downloaded_then_checked(
    docker_node: Node, sim_model: CatalogModel, stack: str, settings: Any
) -> None:
    settings.TOLLGATE_STAGE_ENTRYPOINT = ["python3", "-c", FAKE_HF]
    settings.HF_TOKEN = "hf_test_token"
    lora_deployment(sim_model, docker_node)
    adapter = adapters.create_adapter(
        None, served_name="acme/legal", base=sim_model, source="acme/legal-lora", tenant=acme()
    )
    op = run_check(adapter)
    assert op.status == OperationStatus.SUCCEEDED, op.error
    assert op.progress == 100 and "is ready (rank 4)" in op.message
    adapter.refresh_from_db()
    assert (adapter.status, adapter.rank) == (AdapterStatus.READY, 4)
    assert "hf_test_token" not in json.dumps(op.detail) + op.message + op.error
    assert containers(stack) == []


@pytest.mark.docker
def test_an_air_gapped_nodes_failed_download_fails_the_check_with_the_helpers_error(
    docker_node: Node, sim_model: CatalogModel, stack: str, settings: Any
) -> None:
    settings.TOLLGATE_STAGE_ENTRYPOINT = ["python3", "-c", FAKE_HF]
    settings.HF_TOKEN = ""
    lora_deployment(sim_model, docker_node)
    adapter = adapters.create_adapter(
        None, served_name="acme/legal", base=sim_model, source="acme/legal-lora", tenant=acme()
    )
    op = run_check(adapter)
    assert op.status == OperationStatus.FAILED and op.phase == "download"
    assert "exit code 1" in op.error and "couldn't connect" in op.error
    adapter.refresh_from_db()
    assert adapter.status == AdapterStatus.FAILED
    assert adapter.status_message.startswith(
        f"Could not download acme/legal-lora on {docker_node.name} (exit code 1): OSError: "
        "We couldn't connect to 'https://huggingface.co' (the node is offline)"
    )
    assert containers(stack) == []
