"""Starting one engine replica and talking to engines over HTTP (health, models, metrics).

The start sequence: pull the image if missing → create the container → start it → wait
until it is running, ``/health`` answers 200 and ``/v1/models`` lists the served name
(shard progress read from the engine's own log meanwhile) → one warm-up request → ready.
Each phase's duration is recorded in the operation's ``detail`` as the cold-start profile.
"""

import contextlib
import functools
import ssl
import time
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from core.changes import publish_change
from deployments import adapter_loading, cluster, placement, progress, runtime
from deployments.choices import ContainerRole, ReplicaState, Task
from deployments.engine_args import to_argv
from deployments.engine_env import engine_environment
from deployments.models import Deployment, Operation, Replica
from deployments.operations import EngineFailed, update_op

PROBE_TIMEOUT = 3.0


@functools.cache
def _trust() -> ssl.SSLContext:
    """The TLS trust httpx builds for every ``httpx.get`` (certifi's roots, or
    ``SSL_CERT_FILE``/``SSL_CERT_DIR``), built once per process: building it costs ~24 ms
    of CPU, and beat scrapes every replica's /metrics every 5 s (3 replicas: 1.4 % of a
    core for nothing, on the cores the gateway serves from)."""
    return httpx.create_ssl_context()


class Starter:
    """Runs the start sequence of one replica, reporting into its operation row."""

    def __init__(self, deployment: Deployment, replica: Replica, op: Operation) -> None:
        self.deployment, self.replica, self.op = deployment, replica, op
        self.node = replica.node or deployment.node
        # A two-box tensor-parallel replica: this is its Ray head; the worker is queued.
        self.group = placement.spans_nodes(deployment) and replica.worker_node_id is not None
        self.worker_op_id: int | None = None
        self.dc = runtime.client(self.node.docker_url)
        self.phases: dict[str, float] = {}
        # The tokens of Tollgate's own warm-up request: on the engine's counters, billed to
        # no tenant, so recorded for whoever reconciles the counters with the bill.
        self.warmup_usage: dict[str, int] | None = None
        # Read before run() sets started_at: a replica that never started is not restarting.
        self.restarting = replica.started_at is not None
        self.container: Any = None

    # -- bookkeeping --

    def report(self, phase: str, progress_pct: float | None = None, message: str = "") -> None:
        detail = dict(self.op.detail)
        entry: dict[str, Any] = {"phases": self.phases}
        if self.warmup_usage is not None:
            entry["warmup_usage"] = self.warmup_usage
        detail.setdefault("replicas", {})[str(self.replica.index)] = entry
        fields: dict[str, Any] = {"phase": phase, "detail": detail}
        if progress_pct is not None:
            fields["progress"] = round(progress_pct, 1)
        if message:
            fields["message"] = message
        update_op(self.op, **fields)

    def set_replica(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self.replica, name, value)
        Replica.objects.filter(pk=self.replica.pk).update(**fields, updated_at=timezone.now())

    def timed(self, phase: str, func: Any, *args: Any) -> Any:
        started = time.monotonic()
        self.report(phase)
        try:
            return func(*args)
        finally:
            self.phases[phase] = round(time.monotonic() - started, 3)
            self.report(phase)

    # -- the sequence --

    def run(self) -> None:
        self.timed("pull", self.pull)
        self.set_replica(state=ReplicaState.STARTING)
        self.timed("create", self.create)
        self.timed("start", runtime.start, self.container)
        if self.group:
            self.worker_op_id = cluster.queue_worker(self.replica).pk
            self.report(
                "start", None, f"Ray head started; worker queued on {self.replica.worker_node}"
            )
        self.locate()
        self.set_replica(state=ReplicaState.LOADING, started_at=timezone.now())
        self.timed("load", self.wait_listening)
        self.timed("models", self.wait_models)
        self.set_replica(state=ReplicaState.WARMING)
        try:
            self.warmup_usage = self.timed(
                "warmup", warm_up, self.replica.base_url, self.deployment
            )
        except httpx.HTTPError as exc:
            raise EngineFailed(f"warm-up request failed: {exc}", None, self.tail()) from exc
        self.restore_adapters()
        self.mark_ready()

    def pull(self) -> None:
        image, policy = self.deployment.image, settings.TOLLGATE_PULL_POLICY
        if policy != "always" and runtime.image_present(self.dc, image):
            return
        if policy == "never":
            raise EngineFailed(
                f"image {image} is not on node {self.node} and TOLLGATE_PULL_POLICY=never "
                "(load it with `docker load` or allow pulls)"
            )
        layers: dict[str, tuple[int, int]] = {}
        last = 0.0
        for event in runtime.pull(self.dc, image):
            progress.record_pull_event(layers, event)
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                pct = progress.pull_progress(layers)
                self.report("pull", pct, f"pulling {image}: {pct:.0f}% of {len(layers)} layers")

    def create(self) -> None:
        stack, name = settings.TOLLGATE_STACK_ID, self.container_name()
        stale = runtime.find(self.dc, name)
        if stale is not None:
            labels = stale.labels or {}
            if (
                labels.get(runtime.LABEL_STACK) != stack
                or labels.get(runtime.LABEL_NODE) != self.node.name
            ):
                raise runtime.RuntimeFailure(
                    f"a container named {name} exists and is not Tollgate's"
                )
            # Our own leftover (a crashed run): we hold the replica, so it is safe to replace.
            runtime.stop_and_remove(stale, 0)
        fields: dict[str, Any] = dict(
            name=name,
            image=self.deployment.image,
            command=engine_command(self.deployment),
            env=engine_environment(self.deployment, self.node),
            labels=runtime.labels_for(
                stack, self.node.name, self.deployment.pk, self.replica.index
            ),
            gpus=self.node.gpu_count > 0,
            engine_host=self.node.engine_host,
            cpus=self.deployment.cpu_limit(self.node.cpu_count or runtime.cpu_count(self.dc)),
        )
        spec = runtime.engine_spec(**{**fields, **self.group_spec()})
        self.container = runtime.create_engine(self.dc, spec)
        self.set_replica(container_id=self.container.id, container_name=name)

    def group_spec(self) -> dict[str, Any]:
        """What makes a container the Ray head of a two-box group (nothing otherwise)."""
        if not self.group:
            return {}
        recipe = cluster.settings_for(self.deployment)
        host = recipe["network"] == cluster.HOST_NETWORK
        env = {
            **cluster.node_env(self.node),
            **engine_environment(self.deployment, self.node),
            "VLLM_HOST_IP": self.node.cluster_address,
        }
        return {
            "entrypoint": cluster.head_entrypoint(self.deployment),
            "command": cluster.head_command(engine_command(self.deployment)),
            "env": env,
            "labels": runtime.labels_for(
                settings.TOLLGATE_STACK_ID,
                self.node.name,
                self.deployment.pk,
                self.replica.index,
                role=ContainerRole.HEAD,
            ),
            "host_network": host,
            "join_network": not host,
        }

    def container_name(self) -> str:
        name = f"{settings.TOLLGATE_STACK_ID}-{self.deployment.name}-{self.replica.index}"
        # A replica placed by Tollgate may move between nodes; several nodes can share one
        # Docker Engine (tests, demos), so the node is part of the name.
        return name if self.deployment.node_id == self.node.pk else f"{name}-{self.node.name}"

    def locate(self) -> None:
        if self.group and cluster.settings_for(self.deployment)["network"] == cluster.HOST_NETWORK:
            self.set_replica(
                host=self.node.engine_host or self.node.cluster_address, port=runtime.ENGINE_PORT
            )
        elif self.node.engine_host:
            runtime.refresh(self.container)
            port = runtime.published_port(self.container)
            if port is None:
                raise EngineFailed("the engine's port was not published", None, self.tail())
            self.set_replica(host=self.node.engine_host, port=port)
        else:
            self.set_replica(host=self.container.name, port=runtime.ENGINE_PORT)

    def tail(self) -> str:
        if self.container is None:
            return ""
        return runtime.logs_tail(self.container, settings.TOLLGATE_LOG_TAIL_LINES)

    def check_alive(self) -> None:
        if self.worker_op_id is not None:
            failure = cluster.worker_failure(self.worker_op_id)
            if failure:
                raise EngineFailed(
                    f"the Ray worker on {self.replica.worker_node} failed: {failure}",
                    None,
                    self.tail(),
                )
        container = runtime.refresh(self.container)
        if container is None:
            raise EngineFailed("the engine container disappeared while starting")
        if container.status != "running":
            code = runtime.exit_code(container)
            raise EngineFailed(
                f"the engine exited with code {code} while starting", code, self.tail()
            )

    def wait_listening(self) -> None:
        deadline = time.monotonic() + settings.TOLLGATE_ENGINE_READY_TIMEOUT
        while time.monotonic() < deadline:
            self.check_alive()
            shards = progress.shard_progress(runtime.logs_tail(self.container, 20))
            if shards:
                done, total = shards
                self.report("load", 100.0 * done / total, f"loading weights: shard {done}/{total}")
            status = probe_health(self.replica.base_url)
            if status == 200:
                return
            if status is not None and status >= 500:
                raise EngineFailed(f"/health answered {status} while starting", None, self.tail())
            time.sleep(settings.TOLLGATE_ENGINE_POLL_SECONDS)
        raise EngineFailed("the engine did not become healthy in time", None, self.tail())

    def wait_models(self) -> None:
        served = self.deployment.model.served_name
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.check_alive()
            if served in served_models(self.replica.base_url):
                return
            time.sleep(settings.TOLLGATE_ENGINE_POLL_SECONDS)
        raise EngineFailed(f"/v1/models never listed {served!r}", None, self.tail())

    def restore_adapters(self) -> None:
        """Load what the replica held before it (re)started, and the pinned adapters; a
        refused adapter is reported, it does not fail the replica."""
        if not self.deployment.serves_adapters:
            return
        failures = self.timed("adapters", adapter_loading.restore, self.replica)
        if failures:
            self.report("adapters", None, "adapters not loaded: " + "; ".join(failures))

    def mark_ready(self) -> None:
        now = timezone.now()
        updated = Replica.objects.filter(pk=self.replica.pk, state=ReplicaState.WARMING).update(
            state=ReplicaState.READY,
            healthy=True,
            ready_at=now,
            last_health_at=now,
            restart_count=self.replica.restart_count + (1 if self.restarting else 0),
        )
        if updated:
            publish_change("replica", self.replica.pk)
        total = round(sum(self.phases.values()), 3)
        self.phases["total"] = total
        self.report("ready", None, f"replica {self.replica.index} ready in {total:.1f} s")


def engine_command(deployment: Deployment) -> list[str]:
    """``vllm serve`` argv after the image's entrypoint: the model, then the flags."""
    model = deployment.model
    argv = [
        model.source,
        "--served-model-name",
        model.served_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(runtime.ENGINE_PORT),
    ]
    if model.revision:
        argv += ["--revision", model.revision]
    # Embedding and cross-encoder (rerank/score) models run on vLLM's pooling runner.
    if model.task in (Task.EMBED, Task.SCORE) and "runner" not in deployment.effective_args:
        argv += ["--runner", "pooling"]
    return argv + to_argv(deployment.effective_args)


# --- HTTP to engines -----------------------------------------------------------------------


def _headers(key: str = "") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def probe_health(base_url: str, key: str = "") -> int | None:
    """``/health``'s status code, or None when nothing answers (still loading, or gone)."""
    try:
        return httpx.get(
            f"{base_url}/health", timeout=PROBE_TIMEOUT, headers=_headers(key), verify=_trust()
        ).status_code
    except httpx.HTTPError:
        return None


def served_models(base_url: str, key: str = "") -> list[str]:
    try:
        answer = httpx.get(
            f"{base_url}/v1/models", timeout=PROBE_TIMEOUT, headers=_headers(key), verify=_trust()
        )
        return [card["id"] for card in answer.json().get("data", [])] if answer.is_success else []
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        return []


def warm_up(base_url: str, deployment: Deployment) -> dict[str, int]:
    """One tiny request so the first tenant request does not pay the JIT compile; returns
    the tokens it cost the engine (its answer's usage)."""
    model = deployment.model
    if model.task == Task.EMBED:
        path, body = "/v1/embeddings", {"model": model.served_name, "input": "warm-up"}
    elif model.task == Task.SCORE:
        path, body = "/v1/score", {"model": model.served_name, "text_1": "warm", "text_2": "up"}
    else:
        path, body = (
            "/v1/chat/completions",
            {
                "model": model.served_name,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
    answer = httpx.post(
        f"{base_url}{path}",
        json=body,
        timeout=settings.TOLLGATE_WARMUP_TIMEOUT,
        headers={"X-Request-Id": "tollgate-warmup"},
        verify=_trust(),
    )
    answer.raise_for_status()
    return warmup_usage(answer)


def warmup_usage(answer: httpx.Response) -> dict[str, int]:
    """(prompt, completion) tokens of the warm-up's answer; zeros when it reports none."""
    try:
        usage = answer.json().get("usage") or {}
    except (ValueError, AttributeError):
        usage = {}
    return {
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
    }


TELEMETRY_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",  # before late 2025
}
TELEMETRY_COUNTERS = {
    "vllm:prompt_tokens": "prompt_tokens_total",
    "vllm:generation_tokens": "generation_tokens_total",
    "vllm:prompt_tokens_cached": "prompt_tokens_cached_total",
    "vllm:num_preemptions": "preemptions_total",
}


# The samples parse_metrics reads. An engine's /metrics is mostly histogram buckets and
# families nobody here reads (the simulator's: 16 kB, 207 lines, 9 of them read; vLLM's is
# larger), and prometheus_client's parser costs ~33 µs a line in Python: parsing the whole
# text took 6.8 ms of the worker's CPU per replica every 5 s (0.6 ms with only these).
_READ = frozenset(
    {
        *TELEMETRY_GAUGES,
        *(f"{name}_total" for name in TELEMETRY_COUNTERS),
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
        "vllm:cache_config_info",
    }
)


def _read_lines(text: str) -> str:
    """The sample lines of ``text`` whose metric name parse_metrics reads (no comments:
    samples without their ``# TYPE`` line parse as untyped, under the same names)."""
    kept = [line for line in text.splitlines() if line.partition("{")[0].partition(" ")[0] in _READ]
    return "\n".join(kept) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """The engine figures the gateway and console use, summed over label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(_read_lines(text)):
        for sample in family.samples:
            if sample.name in TELEMETRY_GAUGES:
                key = TELEMETRY_GAUGES[sample.name]
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name.endswith("_total") and sample.name[:-6] in TELEMETRY_COUNTERS:
                key = TELEMETRY_COUNTERS[sample.name[:-6]]
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_sum":
                out["ttft_seconds_sum"] = out.get("ttft_seconds_sum", 0.0) + sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_count":
                out["ttft_count"] = out.get("ttft_count", 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info":
                # The KV cache in tokens: num_gpu_blocks blocks of block_size tokens.
                with contextlib.suppress(KeyError, ValueError):
                    out["kv_capacity_tokens"] = float(
                        int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
                    )
    return out


def scrape(base_url: str, key: str = "") -> dict[str, float] | None:
    try:
        answer = httpx.get(
            f"{base_url}/metrics", timeout=PROBE_TIMEOUT, headers=_headers(key), verify=_trust()
        )
    except httpx.HTTPError:
        return None
    return parse_metrics(answer.text) if answer.is_success else None


def in_flight(figures: dict[str, float] | None) -> float | None:
    """The requests a scrape found the engine running or queueing (None: no scrape)."""
    if figures is None:
        return None
    return figures.get("running", 0.0) + figures.get("waiting", 0.0)


def wait_idle(base_url: str, timeout: float) -> bool:
    """Wait until the engine runs and queues nothing (True), or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not in_flight(scrape(base_url)):
            return True
        time.sleep(0.2)
    return False
