"""What the Docker API policy (the docker-proxy service) adds to a deploy and to pull progress.

Two measurements, each direct to the Docker socket and through ``python -m dockerpolicy``
on a loopback port (a separate process, as in the appliance):

``deploy``  the Docker calls of one simulator deploy, in the order the worker makes them
            (SDK client, image inspect, container inspect, create, start, five rounds of
            inspect + 20-line log tail while it loads, stop, remove), on the real Docker
            Engine with the simulator image; median total per round, and the median of
            each read call over --calls repetitions. Hold the Docker lock: it starts
            containers (flock /tmp/tollgate-docker.lock …).
``pull``    pull-progress streaming from a stand-in Engine on a unix socket (no registry is
            reachable here), a separate process writing progress lines as ``docker pull``
            does: the delay from a line's write to its arrival at the client, one line every
            5 ms, and the time to stream 20 MB of lines as fast as they come.

    flock /tmp/tollgate-docker.lock .venv/bin/python bench/docker_policy_bench.py deploy
    .venv/bin/python bench/docker_policy_bench.py pull
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = "tollgate/engine-sim:latest"
SIM_ARGS = [
    "Qwen/Qwen3-0.6B",
    "--served-model-name",
    "bench",
    "--port",
    "8000",
    "--sim-load-seconds",
    "0.2",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def policy(stack: str, socket_path: str) -> Iterator[str]:
    """``python -m dockerpolicy`` in front of ``socket_path``; yields its tcp:// URL."""
    port = free_port()
    env = {
        **os.environ,
        "TOLLGATE_STACK_ID": stack,
        "TOLLGATE_ENGINE_IMAGES": "tollgate/engine-sim:*",
        "TOLLGATE_MODEL_CACHE_VOLUME": f"{stack}-models",
        "TOLLGATE_COMPILE_CACHE_VOLUME": f"{stack}-compile",
        "TOLLGATE_ENGINE_NETWORK": f"{stack}-net",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dockerpolicy",
            "--listen",
            f"127.0.0.1:{port}",
            "--docker-socket",
            socket_path,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port)
        yield f"tcp://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def wait_port(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


# --- deploy --------------------------------------------------------------------------------------


def deploy_round(url: str, stack: str) -> float:
    """The Docker calls of one deploy (deployments/engine.py + runtime.py), timed."""
    import docker

    started = time.perf_counter()
    dc = docker.DockerClient(base_url=url, timeout=60)
    dc.images.get(IMAGE)
    name = f"{stack}-bench-{uuid.uuid4().hex[:6]}"
    try:
        dc.containers.get(name)
    except docker.errors.NotFound:
        pass
    container = dc.containers.create(
        IMAGE,
        SIM_ARGS,
        name=name,
        environment={"SIM_TTFT_MS": "1"},
        labels={"tollgate.managed": "true", "tollgate.stack": stack, "tollgate.node": "bench"},
        shm_size="1g",
        volumes={
            f"{stack}-models": {"bind": "/root/.cache/huggingface", "mode": "rw"},
            f"{stack}-compile": {"bind": "/root/.cache/vllm", "mode": "rw"},
        },
        log_config={"type": "json-file", "config": {"max-size": "50m", "max-file": "3"}},
        security_opt=["no-new-privileges"],
        ports={"8000/tcp": ("127.0.0.1", None)},
        detach=True,
    )
    container.start()
    for _ in range(5):
        container.reload()
        container.logs(tail=20)
    container.stop(timeout=3)
    container.remove(force=True)
    return time.perf_counter() - started


def median_call(call: Callable[[object], object], client: object, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call(client)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_deploy(rounds: int, calls: int, socket_path: str) -> None:
    import docker

    stack = f"tgbench{uuid.uuid4().hex[:6]}"
    direct_url = f"unix://{socket_path}"
    with policy(stack, socket_path) as proxied_url:
        totals: dict[str, list[float]] = {"direct": [], "policy": []}
        for _ in range(rounds):  # alternate, so drift on a shared machine hits both alike
            totals["direct"].append(deploy_round(direct_url, stack))
            totals["policy"].append(deploy_round(proxied_url, stack))
        print(f"deploy: Docker calls of one simulator deploy, median of {rounds} rounds")
        d, p = statistics.median(totals["direct"]), statistics.median(totals["policy"])
        print(
            f"  direct {1000 * d:8.1f} ms   policy {1000 * p:8.1f} ms   added "
            f"{1000 * (p - d):6.1f} ms"
        )
        direct, proxied = (
            docker.DockerClient(base_url=direct_url),
            docker.DockerClient(base_url=proxied_url),
        )
        keeper = direct.containers.run(
            IMAGE,
            SIM_ARGS,
            name=f"{stack}-keeper",
            detach=True,
            labels={"tollgate.managed": "true", "tollgate.stack": stack},
        )
        try:
            filters = {"label": ["tollgate.managed=true", f"tollgate.stack={stack}"]}
            print(f"per call, median of {calls}:")
            for label, fn in (
                ("version", lambda c: c.api.version()),
                ("image inspect", lambda c: c.api.inspect_image(IMAGE)),
                ("container inspect", lambda c: c.api.inspect_container(keeper.id)),
                ("logs tail=20 (+ owner check)", lambda c: c.api.logs(keeper.id, tail=20)),
                ("list by label", lambda c: c.api.containers(all=True, filters=filters)),
            ):
                d, p = median_call(fn, direct, calls), median_call(fn, proxied, calls)
                print(
                    f"  {label:30} direct {1000 * d:6.2f} ms   policy {1000 * p:6.2f} ms   "
                    f"added {1000 * (p - d):5.2f} ms"
                )
        finally:
            keeper.remove(force=True)
            for name in (f"{stack}-models", f"{stack}-compile"):
                try:
                    direct.volumes.get(name).remove(force=True)
                except docker.errors.NotFound:
                    pass


# --- pull progress -------------------------------------------------------------------------------


def fake_engine(socket_path: str) -> None:
    """A stand-in Engine: /images/create streams progress lines carrying their write time."""
    from aiohttp import web

    async def pull(request: web.Request) -> web.StreamResponse:
        mode = request.query["tag"]
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if mode == "paced":
            for n in range(2000):
                line = {
                    "status": "Downloading",
                    "id": "layer",
                    "progressDetail": {"current": n, "total": 2000},
                    "sent": time.monotonic_ns(),
                }
                await response.write(json.dumps(line).encode() + b"\r\n")
                await asyncio.sleep(0.005)
        else:
            line = json.dumps(
                {
                    "status": "Downloading",
                    "id": "0123456789ab",
                    "progressDetail": {"current": 1, "total": 2},
                    "progress": "[=>  ] " + "x" * 80,
                }
            )
            block = (line.encode() + b"\r\n") * 100
            for _ in range(20 * 2**20 // len(block)):
                await response.write(block)
        await response.write_eof()
        return response

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"ApiVersion": "1.41"})

    app = web.Application()
    app.router.add_post("/v1.41/images/create", pull)
    app.router.add_get("/version", version)
    web.run_app(app, path=socket_path, print=None, access_log=None)


def stream(client: object, url: str, tag: str) -> tuple[list[float], int, float]:
    """(per-line delays in ms, bytes, seconds) of one pull-progress stream."""
    delays, size, started = [], 0, time.perf_counter()
    with client.stream(
        "POST", f"{url}/v1.41/images/create?fromImage=tollgate%2Fengine-sim&tag={tag}"
    ) as answer:
        for line in answer.iter_lines():
            size += len(line) + 2
            if tag == "paced":
                delays.append((time.monotonic_ns() - json.loads(line)["sent"]) / 1e6)
    return delays, size, time.perf_counter() - started


def bench_pull() -> None:
    import httpx

    directory = tempfile.mkdtemp(prefix="tgdpb-", dir="/tmp")
    socket_path = os.path.join(directory, "docker.sock")
    engine = subprocess.Popen([sys.executable, __file__, "fake-engine", socket_path], cwd=ROOT)
    try:
        while not os.path.exists(socket_path):
            time.sleep(0.05)
        with policy("tgbench", socket_path) as proxied:
            clients = {
                "direct": (
                    httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=60),
                    "http://docker",
                ),
                "policy": (httpx.Client(timeout=60), proxied.replace("tcp://", "http://")),
            }
            print(
                "pull progress: one line every 5 ms, 2000 lines; delay from write to arrival (ms)"
            )
            for name, (client, url) in clients.items():
                delays = stream(client, url, "paced")[0]
                q = statistics.quantiles(delays, n=100)
                print(f"  {name:7} p50 {q[49]:6.3f}   p99 {q[98]:6.3f}   max {max(delays):6.3f}")
            print("pull progress: 20 MB of lines as fast as they come (median of 3)")
            for name, (client, url) in clients.items():
                runs = [stream(client, url, "bulk") for _ in range(3)]
                size, seconds = runs[0][1], statistics.median(r[2] for r in runs)
                print(f"  {name:7} {seconds:6.3f} s   {size / seconds / 2**20:7.1f} MB/s")
    finally:
        engine.send_signal(signal.SIGTERM)
        engine.wait(timeout=10)
        if os.path.exists(socket_path):
            os.unlink(socket_path)
        os.rmdir(directory)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["deploy", "pull", "fake-engine"])
    parser.add_argument("socket", nargs="?", default="/var/run/docker.sock")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    if args.what == "deploy":
        bench_deploy(args.rounds, args.calls, args.socket)
    elif args.what == "pull":
        bench_pull()
    else:
        fake_engine(args.socket)


if __name__ == "__main__":
    main()
