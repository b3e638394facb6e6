"""The Docker runtime: the only module that talks to Docker (through the Docker SDK).

Every container Tollgate creates carries its labels; containers are listed and removed
only by label, so Tollgate never touches a container it did not create.
"""

import ipaddress
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO

import docker
from django.conf import settings
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import DeviceRequest, Ulimit

from deployments import relay
from deployments.choices import ReplicaState

ENGINE_PORT = 8000
LABEL_MANAGED = "tollgate.managed"
LABEL_STACK = "tollgate.stack"
LABEL_NODE = "tollgate.node"
LABEL_DEPLOYMENT = "tollgate.deployment"
LABEL_REPLICA = "tollgate.replica"
LABEL_ROLE = "tollgate.role"  # engine | head | worker | stage (choices.ContainerRole)
MISSING = "missing"


class RuntimeFailure(Exception):
    """A Docker operation failed; the message says what Tollgate was doing and why."""


@contextmanager
def wrapped(doing: str) -> Iterator[None]:
    """Turn Docker SDK errors into a RuntimeFailure that names what was being done."""
    try:
        yield
    except APIError as exc:
        reason = exc.explanation or str(exc)
        raise RuntimeFailure(f"{doing}: {reason}") from exc
    except DockerException as exc:
        raise RuntimeFailure(f"{doing}: {exc}") from exc


def client(docker_url: str) -> docker.DockerClient:
    """A Docker client for a node: its Docker API policy, or a joined node's agent."""
    with wrapped(f"connecting to Docker at {docker_url}"):
        if relay.is_relayed(docker_url):
            return relay.client(docker_url)
        return docker.DockerClient(base_url=docker_url, timeout=60)


def replica_state_for(status: str | None, health_status: int | None) -> str:
    """The replica state a container's Docker status and ``/health`` answer mean.

    ``health_status`` is None while nothing listens (the engine is still loading). An
    engine that exited, whatever its exit code (vLLM sometimes exits 0 when it dies),
    or whose ``/health`` answers 503, has crashed.
    """
    if status is None:
        return MISSING
    if status == "created":
        return ReplicaState.STARTING
    if status == "running":
        if health_status is None:
            return ReplicaState.LOADING
        return ReplicaState.READY if health_status == 200 else ReplicaState.CRASHED
    if status == "removing":
        return ReplicaState.STOPPED
    return ReplicaState.CRASHED  # exited, dead, restarting, paused


def labels_for(
    stack: str,
    node: str,
    deployment_id: int | None = None,
    index: int | None = None,
    role: str = "engine",
) -> dict[str, str]:
    labels = {LABEL_MANAGED: "true", LABEL_STACK: stack, LABEL_NODE: node, LABEL_ROLE: role}
    if deployment_id is not None:
        labels[LABEL_DEPLOYMENT] = str(deployment_id)
    if index is not None:
        labels[LABEL_REPLICA] = str(index)
    return labels


def label_filter(stack: str, node: str, **more: str) -> list[str]:
    pairs = {LABEL_MANAGED: "true", LABEL_STACK: stack, LABEL_NODE: node, **more}
    return [f"{k}={v}" for k, v in pairs.items()]


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to create one engine container."""

    name: str
    image: str
    command: list[str]
    env: dict[str, str]
    labels: dict[str, str]
    gpus: bool
    bind_host: str  # publish port 8000 on this address; empty: join the engine network
    network: str
    entrypoint: list[str] | None = None  # None: the image's own (vllm serve)
    ports: tuple[int, ...] = (ENGINE_PORT,)  # container ports published on bind_host
    host_network: bool = False  # a Ray group's NCCL/Ray traffic needs the node's interfaces
    join_network: bool = False  # also join the engine network (a Ray group on one engine)
    cpus: float | None = None  # CPU cores the container may use (Docker's --cpus); None: all


def _publish_address(engine_host: str) -> str:
    try:
        return str(ipaddress.ip_address(engine_host))
    except ValueError:
        return "0.0.0.0"  # a host name: publish on the host's interfaces


def engine_spec(
    name: str,
    image: str,
    command: list[str],
    env: dict[str, str],
    labels: dict[str, str],
    gpus: bool,
    engine_host: str,
    **more: Any,
) -> EngineSpec:
    return EngineSpec(
        name=name,
        image=image,
        command=command,
        env=env,
        labels=labels,
        gpus=gpus,
        bind_host=_publish_address(engine_host) if engine_host else "",
        network=settings.TOLLGATE_ENGINE_NETWORK,
        **more,
    )


MODEL_CACHE = "/root/.cache/huggingface"  # where engines and helpers mount the model cache


def cache_mounts() -> dict[str, dict[str, str]]:
    """The shared model cache and the compile cache, as named volumes."""
    return {
        settings.TOLLGATE_MODEL_CACHE_VOLUME: {"bind": MODEL_CACHE, "mode": "rw"},
        settings.TOLLGATE_COMPILE_CACHE_VOLUME: {"bind": "/root/.cache/vllm", "mode": "rw"},
    }


def create_engine(dc: docker.DockerClient, spec: EngineSpec) -> Container:
    """Create (not start) an engine container; Docker refuses a second one of that name."""
    kwargs: dict[str, Any] = {
        "name": spec.name,
        "command": spec.command,
        "environment": spec.env,
        "labels": spec.labels,
        # PyTorch's workers share tensors through /dev/shm: a large private one, as vLLM's
        # own multi-node recipe uses, rather than the host's IPC namespace (ipc=host).
        "shm_size": settings.TOLLGATE_ENGINE_SHM_SIZE,
        "volumes": cache_mounts(),
        "log_config": {"type": "json-file", "config": {"max-size": "50m", "max-file": "3"}},
        "security_opt": ["no-new-privileges"],
        "detach": True,
    }
    if spec.gpus:
        kwargs["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
        # NVIDIA's recommended limits for PyTorch engines (GPU hosts allow raising them).
        kwargs["ulimits"] = [
            Ulimit(name="memlock", soft=-1, hard=-1),
            Ulimit(name="stack", soft=67108864, hard=67108864),
        ]
    if spec.cpus:
        kwargs["nano_cpus"] = round(spec.cpus * 1e9)
    if spec.entrypoint is not None:
        kwargs["entrypoint"] = spec.entrypoint
    if spec.host_network:
        kwargs["network_mode"] = "host"
    else:
        if spec.bind_host and spec.ports:
            kwargs["ports"] = {f"{port}/tcp": (spec.bind_host, None) for port in spec.ports}
        if not spec.bind_host or spec.join_network:
            kwargs["network"] = spec.network
            ensure_network(dc, spec.network)
    with wrapped(f"creating container {spec.name}"):
        return dc.containers.create(spec.image, **kwargs)


def ensure_network(dc: docker.DockerClient, name: str) -> None:
    with wrapped(f"creating network {name}"):
        if not dc.networks.list(names=[name]):
            dc.networks.create(name, driver="bridge", labels={LABEL_MANAGED: "true"})


def find(dc: docker.DockerClient, name: str) -> Container | None:
    with wrapped(f"inspecting container {name}"):
        try:
            return dc.containers.get(name)
        except NotFound:
            return None


def list_managed(dc: docker.DockerClient, stack: str, node: str, **more: str) -> list[Container]:
    """Tollgate's containers of this stack on this node (never anyone else's). A container
    removed between Docker's list and the inspect of each entry is left out, not an error."""
    with wrapped("listing Tollgate's containers"):
        return dc.containers.list(
            all=True, filters={"label": label_filter(stack, node, **more)}, ignore_removed=True
        )


def start(container: Container) -> None:
    with wrapped(f"starting container {container.name}"):
        container.start()


def refresh(container: Container) -> Container | None:
    """The container re-inspected, or None when it is gone."""
    with wrapped(f"inspecting container {container.name}"):
        try:
            container.reload()
        except NotFound:
            return None
    return container


def published_port(container: Container) -> int | None:
    ports = container.attrs.get("NetworkSettings", {}).get("Ports") or {}
    bindings = ports.get(f"{ENGINE_PORT}/tcp") or []
    return int(bindings[0]["HostPort"]) if bindings else None


def exit_code(container: Container) -> int | None:
    state = container.attrs.get("State", {})
    return state.get("ExitCode") if container.status in {"exited", "dead"} else None


def created_at(container: Container) -> datetime:
    return datetime.fromisoformat(container.attrs["Created"][:26].rstrip("Z") + "+00:00")


def logs_tail(container: Container, lines: int) -> str:
    with wrapped(f"reading logs of {container.name}"):
        try:
            return container.logs(tail=lines).decode("utf-8", "replace")
        except NotFound:
            return ""


def stop_and_remove(container: Container, grace_seconds: int) -> None:
    """SIGTERM, up to ``grace_seconds`` to finish, then SIGKILL; then remove it."""
    with wrapped(f"stopping container {container.name}"):
        try:
            if container.status == "running":
                container.stop(timeout=grace_seconds)
            container.remove(force=True)
        except NotFound:
            pass


def image_present(dc: docker.DockerClient, image: str) -> bool:
    with wrapped(f"looking up image {image}"):
        try:
            dc.images.get(image)
            return True
        except ImageNotFound:
            return False


def pull(dc: docker.DockerClient, image: str) -> Iterator[dict]:
    """Decoded ``docker pull`` progress events; the last one may carry an ``error``."""
    repository, _, tag = (
        image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "latest")
    )
    with wrapped(f"pulling {image}"):
        for event in dc.api.pull(repository, tag=tag, stream=True, decode=True):
            if event.get("error"):
                raise RuntimeFailure(f"pulling {image}: {event['error']}")
            yield event


def info(dc: docker.DockerClient) -> dict[str, Any]:
    with wrapped("reading Docker's system info"):
        return dc.info()


def cpu_count(dc: docker.DockerClient) -> int:
    """The Docker host's CPU cores (0 when it does not say)."""
    return int(info(dc).get("NCPU") or 0)


def run_to_completion(
    dc: docker.DockerClient,
    image: str,
    entrypoint: list[str],
    command: list[str],
    env: dict[str, str],
    labels: dict[str, str],
    name: str,
) -> Container:
    """Start a short-lived helper container with the caches mounted (for staging)."""
    with wrapped(f"starting helper container {name}"):
        return dc.containers.run(
            image,
            entrypoint=entrypoint,
            command=command,
            environment=env,
            labels=labels,
            name=name,
            volumes=cache_mounts(),
            detach=True,
            security_opt=["no-new-privileges"],
            user="0",
        )


def copy_into_cache(
    dc: docker.DockerClient,
    image: str,
    labels: dict[str, str],
    name: str,
    archive: BinaryIO,
) -> None:
    """Put a tar into the model cache: into a helper container that is created with the
    caches mounted and never started, through Docker's archive API (the tar's names start
    at the cache's mount point), then remove the helper."""
    with wrapped(f"creating helper container {name}"):
        helper = dc.containers.create(
            image,
            entrypoint=["true"],
            name=name,
            labels=labels,
            volumes=cache_mounts(),
            security_opt=["no-new-privileges"],
            user="0",
        )
    try:
        with wrapped(f"copying files into the model cache through {name}"):
            helper.put_archive(MODEL_CACHE, archive)
    finally:
        stop_and_remove(helper, 0)


def wait_exit(container: Container, timeout: float) -> int | None:
    """Wait for a helper container to exit; its exit code (None: still running at timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        refresh(container)
        if container.status in {"exited", "dead"}:
            return exit_code(container)
        time.sleep(0.2)
    return None
