"""The linux/arm64 images (the DGX Spark is arm64-only) boot and serve, on an amd64 machine.

The images come from ``scripts/build-images --arch arm64 tollgate engine-sim`` and run under
qemu-user-static through binfmt_misc (``scripts/ensure-services --arm64``); ``./scripts/test
arm64`` does both. The Tollgate container runs with production settings against this
machine's PostgreSQL (a database of its own, dropped afterwards) and Redis (a database number
of its own, emptied afterwards): ``manage.py check --deploy``, migrations, then the gateway
serves one ``/v1/chat/completions`` from the official ``openai`` SDK to the arm64 simulator
engine. Both containers report ``uname -m`` = ``aarch64``; the test prints it.

The Tollgate containers use the host's network because PostgreSQL and Redis listen on
loopback only; the engine sits on Docker's default bridge with its port published on
loopback. Every container carries the run's label and is removed at the end; the test
creates no network or volume. Callers hold ``flock /tmp/tollgate-docker.lock``.
"""

import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import psycopg
import pytest
import redis
from django.db.migrations.loader import MigrationLoader
from openai import OpenAI

from tests import leaks

pytestmark = [pytest.mark.arm64, pytest.mark.timeout(1800)]

TOLLGATE_IMAGE = os.environ.get("TOLLGATE_ARM64_IMAGE", "tollgate/tollgate:arm64")
ENGINE_IMAGE = os.environ.get("TOLLGATE_ARM64_ENGINE_IMAGE", "tollgate/engine-sim:arm64")
PLATFORM = "linux/arm64"
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
# The stage's own Redis database (the batches tests use 13, everything else 0).
REDIS_DB = int(os.environ.get("TOLLGATE_ARM64_REDIS_DB", "12"))
MODEL = "sim-arm64"
# Emulated start-up is slow: generous deadlines, each waiting for a condition.
BOOT_TIMEOUT = 600


def say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    """A line for the stage's log, printed whatever pytest's capture setting."""
    with capsys.disabled():
        print(f"[arm64] {line}", flush=True)


def docker(*args: str, timeout: float = BOOT_TIMEOUT, check: bool = True) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args[:3])} … failed ({done.returncode}):\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
    return done.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def image_arch(image: str) -> str:
    out = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", image],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, (
        f"{image} is missing: build it with `scripts/build-images --arch arm64 tollgate "
        f"engine-sim` (./scripts/test arm64 does)"
    )
    return out.stdout.strip()


@dataclass
class Run:
    """One run's names, settings and the containers it started."""

    label: str = field(default_factory=lambda: leaks.unique_name("tgarm64"))
    port: int = field(default_factory=free_port)
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(48))
    pepper: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def database(self) -> str:
        return self.label.replace("-", "_")

    def env(self) -> dict[str, str]:
        """Production settings, as an operator behind a TLS-terminating proxy sets them."""
        return {
            "TOLLGATE_ENV": "production",
            "DJANGO_SECRET_KEY": self.secret_key,
            "TOLLGATE_KEY_PEPPER": self.pepper,
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{self.database}",
            "REDIS_URL": f"redis://127.0.0.1:6379/{REDIS_DB}",
            "TOLLGATE_REDIS_PREFIX": self.label,
            "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
            "TOLLGATE_HTTPS": "true",
            "TOLLGATE_TRUST_X_FORWARDED_PROTO": "true",
            "TOLLGATE_PUBLIC_URL": f"https://127.0.0.1:{self.port}",
            "TOLLGATE_ADMIN_PASSWORD": secrets.token_urlsafe(18),
            # The host's network: listen on loopback only.
            "TOLLGATE_WEB_HOST": "127.0.0.1",
            "TOLLGATE_WEB_PORT": str(self.port),
            "TOLLGATE_WEB_WORKERS": "1",
            "TOLLGATE_LOCAL_NODE_NAME": "spark-arm64",
        }

    def tollgate(self, *args: str, detach: bool = False, name: str = "") -> str:
        """``docker run`` of the arm64 Tollgate image on the host network."""
        env = [item for k, v in self.env().items() for item in ("-e", f"{k}={v}")]
        mode = ["-d", "--name", f"{self.label}-{name}"] if detach else ["--rm"]
        return docker(
            "run",
            *mode,
            "--platform",
            PLATFORM,
            "--network",
            "host",
            "--label",
            f"tollgate.test={self.label}",
            *env,
            TOLLGATE_IMAGE,
            *args,
        )


def wait_http(url: str, container: str, timeout: float = BOOT_TIMEOUT, **kw: object) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        state = docker("inspect", "--format", "{{.State.Status}}", container).strip()
        if state != "running":
            raise AssertionError(f"{container} is {state}:\n{logs(container)[-6000:]}")
        try:
            answer = httpx.get(url, timeout=10, **kw)
            if answer.status_code == 200:
                return
            last = f"{answer.status_code} {answer.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(1)
    raise AssertionError(f"{url} never answered 200 ({last}):\n{logs(container)[-6000:]}")


def logs(container: str) -> str:
    done = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    return done.stdout + done.stderr


def uname_m(container: str) -> str:
    return docker("exec", container, "uname", "-m").strip()


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    run = Run()
    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:
        conn.execute(f'CREATE DATABASE "{run.database}"')
    try:
        yield run
    finally:
        ids = docker("ps", "-aq", "--filter", f"label=tollgate.test={run.label}").split()
        if ids:
            docker("rm", "-f", "-v", *ids, check=False)
        with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{run.database}" WITH (FORCE)')
        # The stage's own database number: the app's keys and anything queued for Celery.
        redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB).flushdb()
    left = docker("ps", "-aq", "--filter", f"label=tollgate.test={run.label}").split()
    assert left == [], f"containers left behind: {left}"


SETUP = """
from decimal import Decimal
from deployments import fleet, services as deployments
from metering import services as metering
from tenants import services as tenants
model = deployments.create_model(None, served_name="MODEL", source="tollgate/sim",
                                 params_billions=Decimal("0.5"), context_length=4096)
metering.set_price(None, model, Decimal("1.00"), Decimal("0.50"), Decimal("2.00"))
tenant = tenants.create_tenant(None, name="Arm Research", slug="arm")
deployment = deployments.create_deployment(None, name="sim-arm64", model=model, external=True,
                                           external_url="ENGINE_URL")
replica = fleet.check_external(deployment)
assert replica.state == "ready", (replica.state, replica.last_error)
print("KEY=" + tenants.issue_api_key(None, tenant, name="arm64").plaintext)
"""


def test_arm64_images_migrate_and_serve_a_chat_completion(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert image_arch(TOLLGATE_IMAGE) == PLATFORM
    assert image_arch(ENGINE_IMAGE) == PLATFORM

    # Django's deployment checks with production settings: no error, no warning.
    out = run.tollgate("manage", "check", "--deploy", "--fail-level", "WARNING")
    assert "System check identified no issues" in out, out
    say(capsys, f"manage.py check --deploy: {out.strip()} ({time.monotonic() - started:.0f} s)")

    # The image's `migrate` role: every migration of the code, the first admin, the node.
    out = run.tollgate("migrate")
    loader = MigrationLoader(None, ignore_no_migrations=True)
    with psycopg.connect(dbname=run.database, **PG) as conn:
        applied = set(conn.execute("SELECT app, name FROM django_migrations").fetchall())
        nodes = conn.execute("SELECT name FROM deployments_node").fetchall()
    missing = set(loader.disk_migrations) - applied
    assert not missing, f"migrations not applied: {sorted(missing)}\n{out}"
    assert nodes == [("spark-arm64",)], out
    say(capsys, f"migrate: {len(applied)} migrations applied ({time.monotonic() - started:.0f} s)")

    # The arm64 simulator engine, published on loopback only.
    engine = f"{run.label}-engine"
    docker(
        "run",
        "-d",
        "--name",
        engine,
        "--platform",
        PLATFORM,
        "--label",
        f"tollgate.test={run.label}",
        "-p",
        "127.0.0.1::8000",
        ENGINE_IMAGE,
        MODEL,
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "4096",
    )
    engine_port = json.loads(
        docker("inspect", "--format", "{{json .NetworkSettings.Ports}}", engine)
    )
    engine_url = f"http://127.0.0.1:{engine_port['8000/tcp'][0]['HostPort']}"
    wait_http(f"{engine_url}/health", engine)

    # A model, its price, a tenant with a key, and the engine as an external deployment,
    # health-checked from the arm64 image the way the reconcile pass does it.
    code = SETUP.replace("MODEL", MODEL).replace("ENGINE_URL", engine_url)
    out = run.tollgate("manage", "shell", "-c", code)
    key = next(line[4:] for line in out.splitlines() if line.startswith("KEY="))

    # The arm64 gateway (the image's `web` role), behind a TLS-terminating proxy as
    # production expects: the proxy says so with X-Forwarded-Proto.
    web = f"{run.label}-web"
    run.tollgate("web", detach=True, name="web")
    base = f"http://127.0.0.1:{run.port}"
    wait_http(f"{base}/healthz", web)
    say(capsys, f"arm64 gateway and engine up ({time.monotonic() - started:.0f} s)")

    client = OpenAI(
        base_url=f"{base}/v1",
        api_key=key,
        max_retries=0,
        timeout=120,
        default_headers={"X-Forwarded-Proto": "https"},
    )
    question = [{"role": "user", "content": "Which machine answers this?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=question, max_tokens=8
    )
    reply = raw.parse()
    direct = httpx.post(
        f"{engine_url}/v1/chat/completions",
        json={"model": MODEL, "messages": question, "max_tokens": 8},
        timeout=120,
    ).json()
    # The engine's own answer, relayed by the gateway, metered with its real usage.
    assert reply.model == MODEL
    assert reply.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert reply.usage.completion_tokens == 8
    assert raw.headers["x-request-id"]

    # The containers that answered run aarch64 code.
    for role, container in (("gateway", web), ("engine", engine)):
        machine = uname_m(container)
        say(capsys, f"{role} container {container} ({PLATFORM}): uname -m = {machine}")
        assert machine == "aarch64"
    # …and the web container is the one serving: its gunicorn logged the request.
    assert "POST /v1/chat/completions" in logs(web)
    say(
        capsys,
        f"/v1/chat/completions answered through the arm64 gateway by the arm64 engine: "
        f"{reply.choices[0].message.content!r}, request {raw.headers['x-request-id']} "
        f"({time.monotonic() - started:.0f} s in all)",
    )
