"""The appliance end to end: `docker compose up -d` with the locally built images, then
what an admin and a tenant do through its HTTPS front (Caddy with its internal CA, whose
root the clients pin), and `docker compose down`.

Needs the images from `scripts/build-images compose` and Docker Compose v2
(`./scripts/test compose` provides both). Each run is its own Compose project on a free
loopback port, with its own engine network, stack id and cache volumes, and is torn down
even when a test fails. Engines are the simulator image: there is no GPU here.
"""

import csv
import io
import json
import os
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests import leaks
from tests.deployments.test_adapter_archives import GOOD, make_tar

pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
ADMIN_PASSWORD = "compose-test-admin-password-42"
# The local stand-ins for the official images (scripts/build-images builds them).
LOCAL_IMAGES = {
    "TOLLGATE_IMAGE": "tollgate/tollgate:latest",
    "TOLLGATE_PYTHON_IMAGE": "tollgate/python:3.11-bookworm",
    "TOLLGATE_POSTGRES_IMAGE": "tollgate/postgres:bookworm",
    "TOLLGATE_REDIS_IMAGE": "tollgate/redis:bookworm",
    "TOLLGATE_CADDY_IMAGE": "tollgate/caddy:bookworm",
}
# Where the `https` service keeps its internal CA's root certificate (docs/operations/https.md).
CA_PATH = "/data/caddy/pki/authorities/local/root.crt"
SIM_IMAGE = "tollgate/engine-sim:latest"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    """One Compose project of the appliance, driven through the `docker compose` CLI.

    ``port`` is its HTTPS port; ``ca`` the file holding the root certificate of the stack's
    internal CA once ``fetch_ca`` has exported it: every client here trusts that and
    nothing else (not the system store, not "verify off").
    """

    project: str
    port: int
    env: dict[str, str]
    token: str = ""
    ca: str = ""
    # Override files read after docker-compose.yml (as COMPOSE_FILE in .env would name them).
    overrides: list[str] = field(default_factory=list)
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"https://127.0.0.1:{self.port}"

    def compose(self, *args: str, check: bool = True, timeout: float = 300) -> str:
        cmd = [
            "docker",
            "compose",
            "-p",
            self.project,
            "-f",
            str(ROOT / "docker-compose.yml"),
            *(arg for path in self.overrides for arg in ("-f", path)),
            *args,
        ]
        done = subprocess.run(
            cmd, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def fetch_ca(self, timeout: float = 60) -> str:
        """Exports the internal CA's root certificate, as docs/operations/https.md tells an admin
        to."""
        deadline = time.monotonic() + timeout
        while True:
            pem = self.compose("exec", "-T", "https", "cat", CA_PATH, check=False)
            if "BEGIN CERTIFICATE" in pem or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert "BEGIN CERTIFICATE" in pem, self.compose("logs", "https", check=False)
        path = ROOT / ".pytest-compose" / f"{self.project}-ca.crt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(pem)
        self.ca = str(path)
        return self.ca

    def client(self, **kwargs: object) -> httpx.Client:
        """An HTTP client that trusts exactly the stack's CA."""
        return httpx.Client(base_url=self.url, verify=self.tls(), timeout=30, **kwargs)

    def tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca)

    def api(self) -> httpx.Client:
        return self.client(headers={"Authorization": f"Bearer {self.token}"})

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        if not self.ca:
            self.fetch_ca()
        while time.monotonic() < deadline:
            try:
                with self.client() as client:
                    if client.get("/healthz", timeout=5).status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(
            f"/healthz never answered 200:\n{self.compose('logs', '--tail', '60', check=False)}"
        )

    def managed_containers(self) -> list[str]:
        out = subprocess.run(
            [
                "docker",
                "ps",
                "-aq",
                "--filter",
                "label=tollgate.managed=true",
                "--filter",
                f"label=tollgate.stack={self.project}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return out.split()


def compose_env(project: str, port: int) -> dict[str, str]:
    # Only what the stack needs: the test process's own settings (DATABASE_URL, …) must not
    # leak into the containers through the compose file's ${…} defaults.
    keep = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "LANG")
    env = {name: os.environ[name] for name in keep if name in os.environ}
    env.update({name: os.environ.get(name, default) for name, default in LOCAL_IMAGES.items()})
    env.update(
        {
            "TOLLGATE_HTTPS_PORT": str(port),
            "TOLLGATE_HTTP_PORT": str(free_port()),
            "TOLLGATE_TLS_NAMES": "127.0.0.1, localhost",
            "TOLLGATE_TLS_DEFAULT_NAME": "127.0.0.1",
            "TOLLGATE_BIND_ADDRESS": "127.0.0.1",
            "TOLLGATE_PUBLIC_URL": f"https://127.0.0.1:{port}",
            "TOLLGATE_ADMIN_PASSWORD": ADMIN_PASSWORD,
            "TOLLGATE_STACK_ID": project,
            "TOLLGATE_ENGINE_NETWORK": f"{project}-engines",
            "TOLLGATE_MODEL_CACHE_VOLUME": f"{project}-model-cache",
            "TOLLGATE_COMPILE_CACHE_VOLUME": f"{project}-compile-cache",
            "TOLLGATE_PULL_POLICY": "never",
            "TOLLGATE_WEB_WORKERS": "2",
            "TOLLGATE_WORKER_CONCURRENCY": "2",
            # Every call the docker-proxy allowed, for the record.
            "TOLLGATE_DOCKER_POLICY_LOG": "all",
        }
    )
    return env


def keep_policy_log(stack: "Stack") -> list[str]:
    """The docker-proxy's log so far (while the stack is up), kept under .pytest-dockerpolicy/;
    the lines refusing a call of the Docker SDK (the worker's and the janitor's), which must
    be none. Tests' own probes use another client and are refused on purpose."""
    text = stack.compose("logs", "--no-color", "--no-log-prefix", "docker-proxy", check=False)
    if text.strip():
        (ROOT / ".pytest-dockerpolicy").mkdir(exist_ok=True)
        (ROOT / ".pytest-dockerpolicy" / f"compose-{stack.project}.log").write_text(text)
    return [
        line for line in text.splitlines() if " refused " in line and "(docker-sdk-python/" in line
    ]


def issue_admin_token(stack: Stack) -> str:
    """An admin API token for the bootstrap admin, issued by the app's own service.

    The console login page is not part of this test; everything after this goes through
    the published port.
    """
    code = (
        "from django.contrib.auth import get_user_model; from tenants import services; "
        "user = get_user_model().objects.get(username='admin', is_staff=True); "
        "assert user.check_password(" + repr(ADMIN_PASSWORD) + "); "
        "print('TOKEN=' + services.issue_admin_token(user, name='compose-test').plaintext)"
    )
    out = stack.compose("exec", "-T", "web", "tollgate", "manage", "shell", "-c", code)
    return next(line[6:] for line in out.splitlines() if line.startswith("TOKEN="))


def docs_block(page: str, first_line: str) -> str:
    """The code block of docs/``page`` that starts with ``first_line`` (the docs are what admins
    follow)."""
    text = (ROOT / "docs" / page).read_text()
    start = text.index(f"\n{first_line}\n") + 1
    return text[start : text.index("\n```", start) + 1]


METRICS_TOKEN = "compose-test-metrics-token-" + uuid.uuid4().hex
SECRETS_PAGE = "operations/secrets.md"


def secrets_from_files(stack: Stack, folder: Path) -> None:
    """docs/operations/secrets.md, as written there: its override file, its .env lines and
    the files, owned by the image's user. The first admin's password and the /metrics token
    then come from files only (not from the environment)."""
    (folder / "secrets").mkdir()
    for name, value in {"admin_password": ADMIN_PASSWORD, "metrics_token": METRICS_TOKEN}.items():
        path = folder / "secrets" / name
        path.write_text(value)
        os.chown(path, 10001, 10001)  # as the page's `sudo chown 10001:10001 secrets/*`
        path.chmod(0o400)
    override = docs_block(SECRETS_PAGE, "# compose.secrets.yml, beside docker-compose.yml")
    # Relative paths in an override resolve against the project folder (the repository).
    (folder / "compose.secrets.yml").write_text(
        override.replace("./secrets/", f"{folder}/secrets/")
    )
    stack.overrides.append(str(folder / "compose.secrets.yml"))
    for line in docs_block(SECRETS_PAGE, "# .env").splitlines()[1:]:
        name, _, value = line.partition("=")
        if name != "COMPOSE_FILE":  # stands for the -f options above
            stack.env[name] = value
    del stack.env["TOLLGATE_ADMIN_PASSWORD"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    project = leaks.unique_name("tgci")
    port = free_port()
    stack = Stack(project, port, compose_env(project, port))
    secrets_from_files(stack, tmp_path_factory.mktemp("compose-secrets"))
    try:
        stack.compose("up", "-d", "--no-build", "--pull", "never", timeout=600)
        stack.wait_healthy()
        stack.token = issue_admin_token(stack)
        yield stack
    finally:
        refused = keep_policy_log(stack)
        stack.compose("down", "-v", "--timeout", "30", check=False)
        # Whatever a failed test left: this run's engines and cache volumes.
        leftovers = stack.managed_containers()
        if leftovers:
            subprocess.run(["docker", "rm", "-f", *leftovers], capture_output=True)
        subprocess.run(
            ["docker", "volume", "rm", "-f", f"{project}-model-cache", f"{project}-compile-cache"],
            capture_output=True,
        )
        subprocess.run(["docker", "network", "rm", f"{project}-engines"], capture_output=True)
    assert not refused, f"the Docker API policy refused the worker's own calls: {refused}"


def post(api: httpx.Client, path: str, body: dict) -> dict:
    answer = api.post(path, json=body)
    assert answer.status_code == 201, f"POST {path}: {answer.status_code} {answer.text}"
    return answer.json()


def wait_ready(api: httpx.Client, name: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        deployment = api.get(f"/api/v1/deployments/{name}/").json()
        if deployment["state"] == "ready":
            return deployment
        assert deployment["state"] != "failed", deployment
        time.sleep(1)
    raise AssertionError(f"deployment {name} never became ready: {deployment}")


@dataclass
class Traffic:
    """Requests one after another, streaming and not, recording each success's request id."""

    client: OpenAI
    model: str
    succeeded: list[str] = field(default_factory=list)
    failed: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def one(self, stream: bool) -> str:
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model,
            messages=[{"role": "user", "content": "Count to three."}],
            max_tokens=12,
            stream=stream,
        )
        request_id = raw.headers["x-request-id"]
        if stream:
            chunks = list(raw.parse())
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            assert raw.parse().usage.completion_tokens > 0
        return request_id

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self.succeeded.append(self.one(stream=n % 2 == 0))
            except Exception:  # noqa: BLE001 - a restart refuses connections for a moment
                self.failed += 1
                time.sleep(0.2)


def stream_unbuffered(client: OpenAI, model: str) -> str:
    """Server-sent events come through the TLS front as the engine makes them, not in one
    piece at the end: the simulator decodes 50 tokens/s by default, so 40 tokens take
    ~0.8 s and half of them must have arrived in the first half of that."""
    start = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=40,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    arrivals = [
        time.monotonic() - start
        for chunk in raw.parse()
        if chunk.choices and chunk.choices[0].delta.content
    ]
    assert len(arrivals) >= 30, arrivals
    total = arrivals[-1]
    assert total > 0.5, arrivals  # the engine took its time...
    assert arrivals[0] < total / 3, arrivals  # ...and the first token did not wait for it
    assert sum(1 for a in arrivals if a < total / 2) >= 10, arrivals
    return raw.headers["x-request-id"]


def test_docker_proxy_allows_only_what_the_worker_needs(stack: Stack) -> None:
    """The docker-proxy service is the Docker API policy: it answers the worker's calls and
    refuses exec and privileged containers however they are spelt; web cannot reach it."""
    probe = """
import json, sys, urllib.parse, urllib.request, urllib.error
def call(method, path, body=None):
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request("http://docker-proxy:2375" + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code
mine = urllib.parse.quote(json.dumps({"label": ["tollgate.managed=true", "tollgate.stack=STACK"]}))
IMAGE = "tollgate/engine-sim:latest"
img = json.dumps(IMAGE).encode()
create = "/v1.41/containers/create?name=STACK-probe"
print(json.dumps({
    "ping": call("GET", "/_ping"),
    "list": call("GET", "/v1.41/containers/json?all=1&filters=" + mine),
    "list_everything": call("GET", "/v1.41/containers/json?all=1"),
    "exec": call("POST", "/v1.41/containers/anything/exec", {"Cmd": ["sh"]}),
    "privileged": call("POST", create, {"Image": IMAGE, "HostConfig": {"Privileged": True}}),
    "privileged_escaped": call(
        "POST", create, b'{"Image": ' + img + b', "HostConfig": {"\\u0050rivileged": true}}'),
    "privileged_lower": call(
        "POST", create, b'{"image": ' + img + b', "hostconfig": {"privileged": true}}'),
    "host_bind": call("POST", create, {"Image": IMAGE, "HostConfig": {"Binds": ["/:/host"]}}),
    "host_bind_escaped": call(
        "POST", create, b'{"Image": ' + img + b', "HostConfig": {"Binds": ["\\u002f:/host"]}}'),
    "host_network": call("POST", create, {"Image": IMAGE, "HostConfig": {"NetworkMode": "host"}}),
    "build": call("POST", "/v1.41/build"),
    "swarm": call("GET", "/v1.41/swarm"),
}))
""".replace("STACK", stack.project)
    out = stack.compose("exec", "-T", "worker", "python3", "-c", probe)
    answers = json.loads(out.strip().splitlines()[-1])
    assert answers == {
        "ping": 200,
        "list": 200,
        "list_everything": 403,
        "exec": 403,
        "privileged": 403,
        "privileged_escaped": 403,
        "privileged_lower": 403,
        "host_bind": 403,
        "host_bind_escaped": 403,
        "host_network": 403,
        "build": 403,
        "swarm": 403,
    }
    # Each refusal is one line of the docker-proxy's log, with its reason.
    log = stack.compose("logs", "--no-color", "docker-proxy")
    assert "HostConfig.Privileged is not allowed" in log and "HostConfig.Binds[0] mounts '/'" in log
    # The internet-facing web process cannot reach the Docker API at all.
    unreachable = stack.compose(
        "exec",
        "-T",
        "web",
        "python3",
        "-c",
        "import socket\ntry:\n socket.create_connection(('docker-proxy', 2375), 3); "
        "print('reached')\n"
        "except OSError: print('unreachable')",
    )
    assert unreachable.strip() == "unreachable"


def test_https_front_redirects_pins_and_hardens(stack: Stack) -> None:
    """Only the TLS front is published: plain HTTP redirects to HTTPS, the certificate is
    the stack's own CA's (a client trusting only the system store refuses it), every
    answer carries HSTS, the session cookie is Secure, and `check --deploy` is clean."""
    http_port = stack.env["TOLLGATE_HTTP_PORT"]
    plain = httpx.get(f"http://127.0.0.1:{http_port}/v1/models?x=1", timeout=10)
    assert plain.status_code == 308
    assert plain.headers["location"] == f"https://127.0.0.1:{stack.port}/v1/models?x=1"
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{stack.url}/healthz", timeout=10)
    # The certificate names both the address and the name the admin listed.
    with httpx.Client(base_url=f"https://localhost:{stack.port}", verify=stack.tls()) as named:
        assert named.get("/healthz").status_code == 200

    with stack.client() as client:
        hsts = "max-age=31536000; includeSubDomains"
        gateway = client.get("/v1/models")
        assert gateway.status_code == 401 and gateway.headers.get_list(
            "strict-transport-security"
        ) == [hsts]
        login = client.get("/login/")
        assert login.status_code == 200
        assert login.headers.get_list("strict-transport-security") == [hsts]
        csrf = next(c for c in login.headers.get_list("set-cookie") if c.startswith("csrftoken="))
        assert "Secure" in csrf
        # A form post from the public origin passes CSRF (a failed login, not a 403).
        failed = client.post(
            "/login/",
            data={
                "csrfmiddlewaretoken": client.cookies["csrftoken"],
                "username": "admin",
                "password": "not-the-password",
            },
            headers={"Referer": f"{stack.url}/login/", "Origin": stack.url},
        )
        assert failed.status_code == 200, failed.text  # CSRF refusals are 403
        assert "Please enter a correct" in failed.text

    deploy = stack.compose(
        "exec", "-T", "web", "tollgate", "manage", "check", "--deploy", "--fail-level", "WARNING"
    )
    assert "no issues" in deploy


def test_secrets_from_files_reach_only_the_services_that_read_them(stack: Stack) -> None:
    """The first admin's password and the /metrics token came from files
    (docs/operations/secrets.md): the admin signs in with it (``issue_admin_token`` checked the
    password), /metrics answers only with the file's token, the files are mounted only where
    the page's override puts them, and neither value is in any container's configuration."""
    with stack.client() as client:
        assert client.get("/metrics").status_code == 404
        wrong = client.get("/metrics", headers={"Authorization": "Bearer not-the-token"})
        assert wrong.status_code == 404
        # No token in the environment: only the file can have switched /metrics on.
        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain; version=")

    def mounted(service: str, name: str) -> bool:
        probe = f"test -r /run/secrets/{name} && echo mounted || echo absent"
        answer = stack.compose("exec", "-T", service, "sh", "-c", probe, timeout=60)
        return answer.strip() == "mounted"

    assert mounted("gateway", "metrics_token")
    for service in ("web", "worker", "usage"):
        assert not mounted(service, "metrics_token"), service
        assert not mounted(service, "admin_password"), service
    containers = stack.compose("ps", "-aq").split()
    inspected = subprocess.run(
        ["docker", "inspect", *containers], capture_output=True, text=True, check=True
    ).stdout
    assert stack.project in inspected  # the configuration of this stack's containers
    assert ADMIN_PASSWORD not in inspected
    assert METRICS_TOKEN not in inspected


def chromium_home_trusting(ca: str, home: Path) -> Path:
    """A HOME whose NSS database trusts the stack's CA, as an admin's browser would once
    they imported it (docs/operations/https.md): Chromium on Linux reads $HOME/.pki/nssdb."""
    nssdb = home / ".pki" / "nssdb"
    nssdb.mkdir(parents=True)
    subprocess.run(["certutil", "-N", "-d", f"sql:{nssdb}", "--empty-password"], check=True)
    subprocess.run(
        ["certutil", "-A", "-d", f"sql:{nssdb}", "-n", "tollgate-ca", "-t", "C,,", "-i", ca],
        check=True,
    )
    return home


@pytest.mark.browser
def test_console_login_over_https_in_chromium(stack: Stack, tmp_path: Path) -> None:
    """The admin logs in to the console in Chromium over HTTPS, certificate errors not
    ignored: the browser trusts the exported CA. Typing the plain-HTTP address lands on
    HTTPS, and the session cookie is Secure and HttpOnly."""
    from playwright.sync_api import sync_playwright

    from tests.browser import tolerate_network_changes

    home = chromium_home_trusting(stack.ca, tmp_path)
    tolerate_network_changes()
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path="/usr/bin/chromium",
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"],
            env={**os.environ, "HOME": str(home)},
        )
        try:
            context = browser.new_context()  # ignore_https_errors stays False
            page = context.new_page()
            page.goto(f"http://127.0.0.1:{stack.env['TOLLGATE_HTTP_PORT']}/login/")
            assert page.url == f"{stack.url}/login/"
            page.fill("#id_username", "admin")
            page.fill("#id_password", ADMIN_PASSWORD)
            page.click("button:has-text('Log in')")
            page.wait_for_url(f"{stack.url}/dashboard/")
            assert page.evaluate("window.isSecureContext") is True
            session = next(c for c in context.cookies() if c["name"] == "sessionid")
            assert session["secure"] and session["httpOnly"]
        finally:
            browser.close()


def test_gateway_process_cannot_write_tenants_keys_or_prices(stack: Stack) -> None:
    """The gateway service (/v1) connects as PostgreSQL's gateway role: its writes to
    tenants, API keys (but their last use), prices and users fail, and it holds neither the
    owner's database password nor a path to it. In Redis it is the `gateway` ACL user: its
    own keys, no deploy or node queue, no dangerous command; strangers may only PING."""
    code = """
import json, os
from django.db import connection, transaction
from django.db.utils import ProgrammingError
from django.utils import timezone
from django.contrib.auth import get_user_model
from tenants.models import ApiKey, Tenant
from metering.models import Price
def redis_attempts():
    import redis
    from core.keyspace import rkey
    from core.redis import get_redis
    r = get_redis()
    def run(*command):
        try:
            r.execute_command(*command)
            return "ok"
        except redis.exceptions.NoPermissionError:
            return "refused"
    anonymous = redis.Redis(host="redis", port=6379)
    try:
        anonymous.get(rkey("anything"))
        stranger = "ok"
    except redis.exceptions.NoPermissionError:
        stranger = "refused"
    return {
        "whoami": r.execute_command("ACL", "WHOAMI").decode(),
        "own_key": run("SET", rkey("acl-probe"), "1"),
        "deploy_queue": run("LPUSH", "control", "{}"),
        "node_queue": run("LPUSH", "node.local", "{}"),
        "other_key": run("GET", "celery-task-meta-x"),
        "flushall": run("FLUSHALL"),
        "config": run("CONFIG", "GET", "*"),
        "keys": run("KEYS", "*"),
        "anonymous_get": stranger,
        "anonymous_ping": anonymous.ping(),
    }
def attempt(write):
    try:
        with transaction.atomic():
            write()
        return "written"
    except ProgrammingError as exc:
        return "refused" if "permission denied" in str(exc) else repr(exc)
print(json.dumps({
    "user": connection.settings_dict["USER"],
    "tenant": attempt(lambda: Tenant.objects.create(name="Evil", slug="evil")),
    "rename": attempt(lambda: Tenant.objects.update(name="owned")),
    "revoke": attempt(lambda: ApiKey.objects.update(revoked_at=timezone.now())),
    "price": attempt(lambda: Price.objects.update(output_per_mtok=0)),
    "admin": attempt(lambda: get_user_model().objects.update(is_superuser=True)),
    "key_use": attempt(lambda: ApiKey.objects.update(last_used_at=timezone.now())),
    "secrets": sorted(os.listdir("/var/lib/tollgate/secrets")),
    "owner_password_in_env": any("postgres_password" in v for v in os.environ.values()),
    "redis": redis_attempts(),
}))
"""
    out = stack.compose("exec", "-T", "gateway", "tollgate", "manage", "shell", "-c", code)
    answers = json.loads(out.strip().splitlines()[-1])
    assert answers == {
        "user": "tollgate_gateway",
        "tenant": "refused",
        "rename": "refused",
        "revoke": "refused",
        "price": "refused",
        "admin": "refused",
        "key_use": "written",
        "secrets": ["gateway_db_password", "key_pepper", "redis_gateway_password", "secret_key"],
        "owner_password_in_env": False,
        # Redis: the gateway's ACL user reaches Tollgate's own keys and nothing else.
        "redis": {
            "whoami": "gateway",
            "own_key": "ok",
            "deploy_queue": "refused",
            "node_queue": "refused",
            "other_key": "refused",
            "flushall": "refused",
            "config": "refused",
            "keys": "refused",
            "anonymous_get": "refused",
            "anonymous_ping": True,
        },
    }
    # The control plane's processes are the `tollgate` user, not the unrestricted default.
    whoami = stack.compose(
        "exec",
        "-T",
        "web",
        "tollgate",
        "manage",
        "shell",
        "-c",
        "from core.redis import get_redis; print(get_redis().execute_command('ACL', 'WHOAMI'))",
    )
    assert whoami.strip().splitlines()[-1] == "b'tollgate'"


# Run in each role's container (`tollgate manage shell`, so as that service's identity): its
# secrets, and what its Redis user may and may not do (config/redisacl.py).
ROLE_PROBE = """
import json, os, redis
from core.keyspace import rkey, usage_stream
from core.redis import get_redis
r = get_redis()
def run(*command):
    try:
        r.execute_command(*command)
        return "ok"
    except redis.exceptions.NoPermissionError:
        return "refused"
    except redis.exceptions.ResponseError:
        return "allowed"  # Redis ran it and found it invalid
print(json.dumps({
    "secrets": sorted(os.listdir("/var/lib/tollgate/secrets")),
    "tenant_data": run("GET", rkey("quota", 1, "x")),
    "usage_stream": run("XINFO", "GROUPS", usage_stream()),
    "append_usage": run("XADD", usage_stream(), "0-0", "e", "{}"),  # an id Redis never takes
    "deploy_queue": run("LLEN", "control"),
    "node_queue": run("LLEN", "node.local"),
    "batch_queue": run("LLEN", "batches"),
    "manage_users": run("ACL", "GETUSER", "default"),
    "config": run("CONFIG", "GET", "*"),
    "flushall": run("FLUSHALL"),
}))
"""


def test_each_process_has_only_its_own_redis_rights_and_secrets(stack: Stack) -> None:
    """The worker, beat, batch runner and usage consumer are each their own Redis ACL user
    with only what their work needs, and their containers hold only their own secrets."""
    answers = {}
    for service in ("worker", "beat", "batches", "usage"):
        out = stack.compose("exec", "-T", service, "tollgate", "manage", "shell", "-c", ROLE_PROBE)
        answers[service] = json.loads(out.strip().splitlines()[-1])
    mine = lambda role, *more: sorted(["secret_key", f"redis_{role}_password", *more])  # noqa: E731
    owner = ("key_pepper", "app_db_password")  # they write rows as the application role
    never = dict.fromkeys(("config", "flushall"), "refused")
    assert answers == {
        # Deployments, telemetry, the usage safety net and the gateway's housekeeping: every
        # Tollgate key and its queues; it restores joined nodes' Redis users.
        "worker": {
            "secrets": mine("worker", *owner),
            "tenant_data": "ok",
            "usage_stream": "ok",
            "append_usage": "allowed",
            "deploy_queue": "ok",
            "node_queue": "ok",
            "batch_queue": "ok",
            "manage_users": "ok",
            **never,
        },
        # Queues periodic tasks on the control queue, nothing else (and has no database).
        "beat": {
            "secrets": mine("beat"),
            "tenant_data": "refused",
            "usage_stream": "refused",
            "append_usage": "refused",
            "deploy_queue": "ok",
            "node_queue": "refused",
            "batch_queue": "refused",
            "manage_users": "refused",
            **never,
        },
        "batches": {
            "secrets": mine("batches", *owner),
            "tenant_data": "refused",
            "usage_stream": "refused",
            "append_usage": "refused",
            "deploy_queue": "refused",
            "node_queue": "refused",
            "batch_queue": "ok",
            "manage_users": "refused",
            **never,
        },
        # Reads and acknowledges the usage stream; cannot append to it or touch anything else.
        "usage": {
            "secrets": mine("usage", *owner),
            "tenant_data": "refused",
            "usage_stream": "ok",
            "append_usage": "refused",
            "deploy_queue": "refused",
            "node_queue": "refused",
            "batch_queue": "refused",
            "manage_users": "refused",
            **never,
        },
    }


# Run in the web, worker, batches and usage containers: who they are to PostgreSQL, that the
# schema is out of their reach while rows are not (config/dbroles.py), and that the owner's
# password (a superuser of the bundled database) is nowhere in the container.
APP_DB_PROBE = """
import json, os
from django.db import ProgrammingError, connection, transaction
def attempt(statement):
    try:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(statement)
            raise RuntimeError("roll back")
    except RuntimeError:
        return "ran"
    except ProgrammingError as exc:
        denied = "must be owner" in str(exc) or "permission denied" in str(exc)
        return "refused" if denied else repr(exc)
print(json.dumps({
    "user": connection.settings_dict["USER"],
    "update_rows": attempt("UPDATE tenants_tenant SET name = name"),
    "alter": attempt("ALTER TABLE tenants_tenant ADD COLUMN owned int"),
    "drop": attempt("DROP TABLE metering_usageevent"),
    "truncate": attempt("TRUNCATE metering_usageevent"),
    "create": attempt("CREATE TABLE owned (x int)"),
    "owner_password_in_env": any("postgres_password" in v for v in os.environ.values()),
    "secrets": sorted(os.listdir("/var/lib/tollgate/secrets")),
}))
"""


def test_no_long_running_service_can_change_the_schema(stack: Stack) -> None:
    for service in ("web", "worker", "batches", "usage"):
        redis_password = "redis_password" if service == "web" else f"redis_{service}_password"
        out = stack.compose(
            "exec", "-T", service, "tollgate", "manage", "shell", "-c", APP_DB_PROBE
        )
        assert json.loads(out.strip().splitlines()[-1]) == {
            "user": "tollgate_app",
            "update_rows": "ran",
            "alter": "refused",
            "drop": "refused",
            "truncate": "refused",
            "create": "refused",
            "owner_password_in_env": False,
            "secrets": sorted(["app_db_password", "key_pepper", redis_password, "secret_key"]),
        }, service
    # The janitor (no database, no Redis) holds the secret key its settings need, nothing else.
    janitor = stack.compose("exec", "-T", "janitor", "ls", "/var/lib/tollgate/secrets")
    assert janitor.split() == ["secret_key"]


def test_keygen_takes_back_secrets_a_service_no_longer_uses(stack: Stack) -> None:
    """An upgraded stack: before the application role, keygen had copied the owner's database
    password into the worker's, batches' and usage's volumes. keygen runs on every
    `docker compose up -d`, and takes such a file back."""

    def volume(*command: str) -> str:
        return stack.compose(
            "run",
            "--rm",
            "--no-deps",
            "--entrypoint",
            "sh",
            "keygen",
            "-c",
            " ".join(command),
            timeout=120,
        )

    leftover = "/var/lib/tollgate-usage/secrets/postgres_password"
    volume("cp", "/var/lib/tollgate/secrets/postgres_password", leftover)
    assert "postgres_password" in volume("ls", "/var/lib/tollgate-usage/secrets")
    stack.compose("run", "--rm", "--no-deps", "keygen", timeout=120)
    assert volume("ls", "/var/lib/tollgate-usage/secrets").split() == [
        "app_db_password",
        "key_pepper",
        "redis_usage_password",
        "secret_key",
    ]


# Run in web (the control plane's user may create users, as it does for joining nodes): a
# short-lived admin user to read who is connected as whom and what Redis refused.
REDIS_OBSERVER = """
import json, secrets, redis
from core.redis import get_redis
control_plane, name, password = get_redis(), "compose-test-observer", secrets.token_hex(16)
rules = ["reset", "on", ">" + password, "~*", "&*", "+@all"]
control_plane.execute_command("ACL", "SETUSER", name, *rules)
try:
    admin = redis.Redis(host="redis", port=6379, username=name, password=password)
    clients = [[c["addr"].rsplit(":", 1)[0], c["user"]] for c in admin.client_list()
               if c["user"] != name]  # not this observer's own connection
    log = [[str(e.get("username")), str(e.get("reason")), str(e.get("object"))]
           for e in admin.acl_log(count=1000)]
    if RESET:
        admin.acl_log_reset()
finally:
    control_plane.execute_command("ACL", "DELUSER", name)
print(json.dumps({"clients": clients, "log": log}))
"""


def redis_users_by_service(
    stack: Stack, reset: bool = False
) -> tuple[dict[str, set[str]], list[list[str]]]:
    """The Redis users each service's live connections authenticated as (by the containers'
    addresses on the backend network), and Redis's ACL log (what it refused, and to whom;
    ``reset`` empties it after reading)."""
    code = f"RESET = {reset}\n{REDIS_OBSERVER}"
    out = stack.compose("exec", "-T", "web", "tollgate", "manage", "shell", "-c", code)
    seen = json.loads(out.strip().splitlines()[-1])
    service_of = {}
    for service in ("web", "gateway", "worker", "beat", "batches", "usage"):
        for container in stack.compose("ps", "-q", service).split():
            networks = json.loads(
                subprocess.run(
                    ["docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", container],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            service_of[networks[f"{stack.project}_backend"]["IPAddress"]] = service
    users: dict[str, set[str]] = {}
    for address, user in seen["clients"]:
        if address in service_of:
            users.setdefault(service_of[address], set()).add(user)
    return users, seen["log"]


def tenant_adapter_answers(stack: Stack, api: httpx.Client, key: str) -> None:
    post(api, "/api/v1/models/", {"served_name": "sim-base", "source": "tollgate/sim-base",
                                  "params_billions": "0.5", "context_length": 8192})  # fmt: skip
    lora = {"enable-lora": True, "max-loras": 1, "max-lora-rank": 8}
    post(api, "/api/v1/deployments/", {"name": "sim-lora", "model": "sim-base", "node": "local",
                                       "image": SIM_IMAGE, "profile": "simulator",
                                       "replicas": 1, "engine_args": lora})  # fmt: skip
    wait_ready(api, "sim-lora")
    archive = make_tar(GOOD, compress=True)
    created = api.post(
        "/api/v1/adapters/",
        data={"served_name": "acme/sea", "base": "sim-base", "tenant": "acme"},
        files={"archive": ("sea.tar.gz", archive, "application/gzip")},
    )
    assert created.status_code == 201, created.text
    deadline = time.monotonic() + 120
    while (adapter := api.get("/api/v1/adapters/acme/sea/").json())["status"] == "checking":
        assert time.monotonic() < deadline, adapter
        time.sleep(1)
    assert adapter["status"] == "ready" and adapter["rank"] == 8, adapter
    client = OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=90,
                    http_client=httpx.Client(verify=stack.tls()))  # fmt: skip
    said = {}
    for model in ("acme/sea", "sim-base"):
        reply = client.chat.completions.create(
            model=model, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Tell me about the sea."}],
        )  # fmt: skip
        assert reply.model == model and reply.choices[0].message.content
        said[model] = reply.choices[0].message.content
    assert said["acme/sea"] != said["sim-base"]  # the adapter, not the base, answered
    loaded = api.get("/api/v1/adapters/acme/sea/").json()
    assert loaded.get("loaded_on"), loaded


def test_compose_appliance_end_to_end(stack: Stack) -> None:
    api = stack.api()
    redis_users_by_service(stack, reset=True)  # earlier tests' probes were refused on purpose

    # First start did everything: migrations, the admin, the local node.
    nodes = api.get("/api/v1/nodes/").json()["results"]
    assert [(n["name"], n["docker_url"]) for n in nodes] == [("local", "tcp://docker-proxy:2375")]

    # An admin sets up a model, its price, a tenant and a key, and deploys the model.
    post(
        api,
        "/api/v1/models/",
        {
            "served_name": "sim-chat",
            "source": "tollgate/sim",
            "params_billions": "0.5",
            "context_length": 8192,
        },
    )
    post(
        api,
        "/api/v1/prices/",
        {
            "model": "sim-chat",
            "currency": "USD",
            "input_per_mtok": "1.00",
            "cached_input_per_mtok": "0.50",
            "output_per_mtok": "2.00",
        },
    )
    post(api, "/api/v1/tenants/", {"name": "Acme Research", "slug": "acme"})
    key = post(api, "/api/v1/keys/", {"tenant": "acme", "name": "compose-test"})["key"]
    post(
        api,
        "/api/v1/deployments/",
        {
            "name": "sim",
            "model": "sim-chat",
            "node": "local",
            "image": SIM_IMAGE,
            "profile": "simulator",
            "replicas": 1,
        },
    )
    deployment = wait_ready(api, "sim")
    assert len(stack.managed_containers()) == 1

    # The engine sits on the internal engine network, published nowhere: only the gateway
    # reaches it.
    engine = json.loads(
        subprocess.run(
            ["docker", "inspect", deployment["replica_set"][0]["container_name"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )[0]
    assert list(engine["NetworkSettings"]["Networks"]) == [f"{stack.project}-engines"]
    assert not engine["HostConfig"]["PortBindings"]
    network = json.loads(
        subprocess.run(
            ["docker", "network", "inspect", f"{stack.project}-engines"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )[0]
    assert network["Internal"] is True

    # A tenant calls it with the official SDK over HTTPS, pinning the appliance's CA.
    client = OpenAI(
        base_url=f"{stack.url}/v1",
        api_key=key,
        max_retries=0,
        timeout=30,
        http_client=httpx.Client(verify=stack.tls()),
    )
    traffic = Traffic(client, "sim-chat")
    first = [traffic.one(stream=False), traffic.one(stream=True)]
    first.append(stream_unbuffered(client, "sim-chat"))
    assert [m.id for m in client.models.list().data] == ["sim-chat"]

    # A Batch API job runs on the batches worker; its requests go through the gateway as P2.
    lines = [
        json.dumps(
            {
                "custom_id": f"b{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "sim-chat",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"hello {n}"}],
                },
            }
        )
        for n in range(3)
    ]
    upload = client.files.create(file=("batch.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 180
    while (
        batch.status not in ("completed", "failed", "expired", "cancelled")
        and time.monotonic() < deadline
    ):
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    results = [
        json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()
    ]
    assert sorted(r["custom_id"] for r in results) == ["b0", "b1", "b2"]
    assert all(r["response"]["status_code"] == 200 for r in results)

    # Restart the gateway, web, the worker and the usage consumer under traffic: every
    # request a client saw succeed is billed.
    thread = threading.Thread(target=traffic.run, daemon=True)
    thread.start()
    time.sleep(3)
    for service in ("gateway", "web", "worker", "usage"):
        stack.compose("restart", service)
        stack.wait_healthy()
        time.sleep(2)
    before_stop = len(traffic.succeeded)
    time.sleep(3)
    traffic.stop.set()
    thread.join(timeout=60)
    assert len(traffic.succeeded) > before_stop, "no request succeeded after the restarts"
    billed = first + traffic.succeeded

    deadline = time.monotonic() + 120
    missing = list(billed)
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if api.get(f"/api/v1/usage/{r}/").status_code != 200]
        time.sleep(2)
    assert not missing, f"{len(missing)} of {len(billed)} successful requests never billed"

    # The showback CSV counts each request once: as many as usage rows, no fewer than the
    # successes (a request cut off mid-stream by the restart is billed for what it got).
    usage_count = api.get("/api/v1/usage/", params={"limit": 1}).json()["count"]
    deadline = time.monotonic() + 60
    while True:
        export = api.get("/api/v1/usage/export.csv", params={"tenant": "acme"})
        assert export.status_code == 200, export.text
        rows = [r for r in csv.DictReader(io.StringIO(export.text)) if r["model"] == "sim-chat"]
        requests = sum(int(r["requests"]) for r in rows)
        if requests == usage_count or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert requests == usage_count >= len(billed)
    assert sum(int(r["completion_tokens"]) for r in rows) > 0
    assert {r["tenant"] for r in rows} == {"acme"}

    # Prometheus, with the /metrics token from its file, sees the tenant's tokens as well
    # (each gateway worker adds what it served within a second or so).
    deadline = time.monotonic() + 60
    while True:
        with stack.client() as client:
            scrape = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert scrape.status_code == 200
        completion = [
            float(line.rsplit(" ", 1)[1])
            for line in scrape.text.splitlines()
            if line.startswith("tollgate_tokens_total{")
            and 'tenant="acme"' in line
            and 'kind="completion"' in line
        ]
        if sum(completion) > 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert sum(completion) > 0, scrape.text

    # A tenant's adapter, uploaded through the admin API, is copied into the model cache and
    # checked by the worker, then loaded on first use: the gateway (as its Redis user) asks
    # the worker for it on the demand queue, and the request waits for it.
    tenant_adapter_answers(stack, api, key)

    # All of that ran with each process connected to Redis as its own ACL user, and none of
    # them was refused anything.
    users, refusals = redis_users_by_service(stack)
    assert {s: users.get(s) for s in ("gateway", "worker", "beat", "batches", "usage")} == {
        "gateway": {"gateway"},
        "worker": {"worker"},
        "beat": {"beat"},
        "batches": {"batches"},
        "usage": {"usage"},
    }, users
    assert users.get("web", {"tollgate"}) == {"tollgate"}
    assert refusals == []

    # The image's `tollgate` command line speaks the same admin API: the same CSV.
    cli = ("exec", "-T", "-e", f"TOLLGATE_TOKEN={stack.token}", "web", "tollgate")
    text = stack.compose(*cli, "usage", "export", "--tenant", "acme")
    cli_rows = [r for r in csv.DictReader(io.StringIO(text)) if r["model"] == "sim-chat"]
    assert sum(int(r["requests"]) for r in cli_rows) == requests
    assert "acme" in stack.compose(*cli, "tenants", "list")

    # `docker compose stop` leaves no engine behind: the janitor removes them, through the
    # Docker API policy, whose log (readable until `down` removes the containers) shows
    # that nothing the worker or the janitor did was refused.
    stack.compose("stop", "--timeout", "30")
    assert stack.managed_containers() == []
    refused = keep_policy_log(stack)
    stack.compose("down", "-v", "--timeout", "30")
    assert refused == []
