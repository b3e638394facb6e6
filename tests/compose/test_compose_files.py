"""The Compose files as Docker Compose itself reads them (`docker compose config`): the
appliance gives each role its own secrets and Redis identity, the node agent's file holds no
control-plane secret, and the cluster overlay publishes Redis only on the address given.

Needs Docker Compose v2 (the compose stage installs it); no image and no container."""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]


def config(*files: str, **env: str) -> dict:
    args = [arg for f in files for arg in ("-f", str(ROOT / f))]
    done = subprocess.run(
        ["docker", "compose", *args, "config", "--format", "json"],
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def volumes(service: dict) -> dict[str, str]:
    return {v["target"]: v["source"] for v in service.get("volumes", [])}


# Beside its secrets, a role's only volume: uploaded adapters, written by web, read by worker.
UPLOADS = {"web": "adapter-uploads", "worker": "adapter-uploads"}


def test_each_role_mounts_only_its_own_secrets_and_has_its_redis_identity() -> None:
    services = config("docker-compose.yml")["services"]
    for role in ("web", "gateway", "worker", "beat", "batches", "usage"):
        mounted = volumes(services[role])
        if role in UPLOADS:
            assert (
                mounted.pop(services[role]["environment"]["TOLLGATE_UPLOAD_DIR"])
                == "adapter-uploads"
            )
        assert mounted == {"/var/lib/tollgate": f"{role}-secrets"}, role
        assert services[role]["environment"]["TOLLGATE_IDENTITY"] == role
        assert volumes(services["keygen"])[f"/var/lib/tollgate-{role}"] == f"{role}-secrets"
    # The janitor has no Redis user or database: its own volume, with the secret key only.
    assert volumes(services["janitor"]) == {"/var/lib/tollgate": "janitor-secrets"}
    assert volumes(services["keygen"])["/var/lib/tollgate-janitor"] == "janitor-secrets"
    worker_uploads = [v for v in services["worker"]["volumes"] if v["source"] == "adapter-uploads"]
    assert worker_uploads[0]["read_only"]  # the worker only reads uploads
    users = {name for name, s in services.items() if "adapter-uploads" in volumes(s).values()}
    assert users == set(UPLOADS)
    # Only migrate (one-shot) keeps the state volume and the database owner's identity.
    assert volumes(services["migrate"]) == {"/var/lib/tollgate": "state"}
    assert "TOLLGATE_IDENTITY" not in services["migrate"]["environment"]
    assert services["beat"]["environment"]["DATABASE_URL"] == "postgres://unused@db/unused"


def test_node_agent_file_parses_and_holds_no_control_plane_secret() -> None:
    env = {
        "TOLLGATE_NODE_NAME": "spark-2",
        "TOLLGATE_CONTROL_PLANE_URL": "https://192.0.2.10",
        "TOLLGATE_NODE_ENGINE_HOST": "192.0.2.11",
        "TOLLGATE_JOIN_TOKEN": "tgj-example",
    }
    services = config("compose/node-agent.yml", **env)["services"]
    assert set(services) == {"agent", "docker-proxy"}
    agent = services["agent"]["environment"]
    assert agent["TOLLGATE_NODE_NAME"] == "spark-2"
    for secret in ("DATABASE_URL", "DJANGO_SECRET_KEY", "TOLLGATE_KEY_PEPPER", "REDIS_URL"):
        assert secret not in agent
    assert volumes(services["agent"]) == {"/var/lib/tollgate": "agent-state"}


def test_cluster_overlay_publishes_redis_on_the_private_address_only() -> None:
    services = config(
        "docker-compose.yml", "compose/cluster.yml", TOLLGATE_CLUSTER_ADDRESS="192.0.2.10"
    )
    redis = services["services"]["redis"]
    assert [(p["host_ip"], p["published"], p["target"]) for p in redis["ports"]] == [
        ("192.0.2.10", "6379", 6379)
    ]
    assert set(redis["networks"]) == {"backend", "cluster"}
    # PostgreSQL stays on the internal network.
    assert "ports" not in services["services"]["db"]
