"""``tollgate adapters create --archive`` and ``tollgate adapters upload`` against a running
Tollgate: a tenant admin uploads her adapter's files and replaces them; a refused archive
exits 1 with the reason; tenant B's admin finds nothing to replace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deployments.adapter_files import UPLOADS
from deployments.models import Adapter
from tests.cli.test_adapters import login_env
from tests.cli.test_cli import cli, fast_password_hashing  # noqa: F401 - fixtures
from tests.deployments.test_adapter_archives import GOOD, make_tar, make_zip


@pytest.fixture
def uploads(settings: Any, tmp_path: Path) -> Path:
    settings.TOLLGATE_UPLOAD_DIR = str(tmp_path / "uploads")
    return tmp_path / "uploads"


def test_a_tenant_admin_uploads_and_replaces_her_adapters_files(
    cli: Any, live_server: Any, alice: Any, carol: Any, public_model: Any, uploads: Path
) -> None:
    env = login_env(live_server, alice)
    files = uploads.parent / "legal.tar.gz"
    files.write_bytes(make_tar(GOOD, compress=True))
    made = cli(
        "adapters", "create", "acme/legal", "--base", "qwen3-8b", "--archive", str(files),
        "--description", "Contracts.", "--json", extra_env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    answer = json.loads(made.stdout)
    assert answer["tenant"] == "acme" and answer["source"].startswith(f"{UPLOADS}/acme--legal-")
    assert answer["description"] == "Contracts."

    newer = uploads.parent / "legal-v2.zip"
    newer.write_bytes(make_zip(GOOD))
    replaced = cli("adapters", "upload", "acme/legal", str(newer), "--json", extra_env=env)
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(replaced.stdout)["source"] != answer["source"]
    assert json.loads(replaced.stdout)["status"] == "checking"

    # Tenant B's admin: no such adapter.
    hidden = cli(
        "adapters", "upload", "acme/legal", str(newer), extra_env=login_env(live_server, carol)
    )
    assert hidden.returncode == 1 and "(404)" in hidden.stderr


def test_a_refused_archive_exits_1_with_the_reason(
    cli: Any, live_server: Any, alice: Any, public_model: Any, uploads: Path
) -> None:
    env = login_env(live_server, alice)
    bad = uploads.parent / "bad.tar"
    bad.write_bytes(make_tar(GOOD, escape="symlink"))
    refused = cli(
        "adapters", "create", "acme/legal", "--base", "qwen3-8b", "--archive", str(bad),
        extra_env=env,
    )  # fmt: skip
    assert refused.returncode == 1 and "(400)" in refused.stderr
    assert "escape: links, devices, pipes and other special files are not allowed" in refused.stderr
    assert not Adapter.objects.exists()
    missing = cli(
        "adapters", "create", "acme/legal", "--base", "qwen3-8b", "--archive", "/nonexistent.tar",
        extra_env=env,
    )  # fmt: skip
    assert missing.returncode == 2 and "No such file" in missing.stderr
    both = cli(
        "adapters", "create", "acme/legal", "--base", "qwen3-8b", "--archive", str(bad),
        "--source", "acme/x", extra_env=env,
    )  # fmt: skip
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
