"""Settings come from the environment; production refuses unsafe configurations."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from config.env import env_bool, env_int, env_list, env_secret

ROOT = Path(__file__).resolve().parents[2]
GOOD_SECRET = "tollgate-test-" + "aB3dE5gH7jK9mN1pQ2rS4tU6vW8xY0z" * 2


def test_env_bool_reads_usual_spellings_and_refuses_nonsense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLAG", "yes")
    assert env_bool("FLAG") is True
    monkeypatch.setenv("FLAG", "off")
    assert env_bool("FLAG", True) is False
    monkeypatch.setenv("FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="FLAG='maybe' is not a boolean"):
        env_bool("FLAG")


def test_env_int_and_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("N", "12")
    monkeypatch.setenv("HOSTS", "a.example, b.example,,")
    assert env_int("N", 1) == 12
    assert env_list("HOSTS") == ["a.example", "b.example"]
    monkeypatch.setenv("N", "twelve")
    with pytest.raises(ImproperlyConfigured, match="not an integer"):
        env_int("N", 1)


def test_env_secret_prefers_the_file_compose_mounts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret_file = tmp_path / "db_url"
    secret_file.write_text("postgres://from-file\n")
    monkeypatch.setenv("DATABASE_URL", "postgres://from-env")
    monkeypatch.setenv("DATABASE_URL_FILE", str(secret_file))
    assert env_secret("DATABASE_URL") == "postgres://from-file"
    monkeypatch.setenv("DATABASE_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="cannot be read"):
        env_secret("DATABASE_URL")


def run_manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO_", "TOLLGATE_", "DATABASE_URL", "REDIS_URL"))
    }
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


PRODUCTION = {
    "TOLLGATE_ENV": "production",
    "DJANGO_SECRET_KEY": GOOD_SECRET,
    "TOLLGATE_KEY_PEPPER": "pepper-" + "Zy9Xw8Vu7Ts6Rq5Po4" * 3,
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/tollgate",
    "REDIS_URL": "redis://127.0.0.1:6379/0",
    "DJANGO_ALLOWED_HOSTS": "tollgate.example.com",
}


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("DJANGO_SECRET_KEY", "DJANGO_SECRET_KEY must be set"),
        ("DATABASE_URL", "DATABASE_URL must be set"),
        ("REDIS_URL", "REDIS_URL must be set"),
    ],
)
def test_production_refuses_to_start_without_required_settings(missing: str, message: str) -> None:
    env = {k: v for k, v in PRODUCTION.items() if k != missing}
    result = run_manage(env, "check")
    assert result.returncode != 0
    assert message in result.stderr


def test_production_refuses_debug_and_short_secret() -> None:
    debug = run_manage({**PRODUCTION, "DJANGO_DEBUG": "true"}, "check")
    assert debug.returncode != 0 and "DJANGO_DEBUG must be off" in debug.stderr
    short = run_manage({**PRODUCTION, "DJANGO_SECRET_KEY": "short"}, "check")
    assert short.returncode != 0 and "at least 50 characters" in short.stderr


def test_check_deploy_is_clean_with_production_settings_over_https() -> None:
    result = run_manage(
        {**PRODUCTION, "TOLLGATE_HTTPS": "true"}, "check", "--deploy", "--fail-level", "WARNING"
    )
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


def test_check_deploy_over_plain_http_warns_with_a_stable_id() -> None:
    result = run_manage(PRODUCTION, "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode != 0
    assert "tollgate.W001" in result.stderr
    assert "security.W012" not in result.stderr  # replaced by the one explicit warning


def test_check_reports_unreachable_redis_as_tollgate_e001() -> None:
    env = {**PRODUCTION, "TOLLGATE_HTTPS": "true", "REDIS_URL": "redis://127.0.0.1:1/0"}
    result = run_manage(env, "check", "--deploy")
    assert result.returncode != 0
    assert "tollgate.E001" in result.stderr


def test_non_postgres_database_is_refused() -> None:
    result = run_manage({"DATABASE_URL": "sqlite:///tmp/x.db"}, "check")
    assert result.returncode != 0
    assert "must point at PostgreSQL" in result.stderr


def test_public_url_origin_is_the_default_trusted_csrf_origin() -> None:
    """Behind the TLS front on another port, forms posted from the public URL pass CSRF;
    an explicit list replaces the default."""
    code = "from django.conf import settings; print(settings.CSRF_TRUSTED_ORIGINS)"
    derived = run_manage(
        {**PRODUCTION, "TOLLGATE_PUBLIC_URL": "https://tollgate.example.com:8443/console"},
        "shell",
        "-c",
        code,
    )
    assert derived.stdout.strip().splitlines()[-1] == "['https://tollgate.example.com:8443']"
    explicit = run_manage(
        {**PRODUCTION, "DJANGO_CSRF_TRUSTED_ORIGINS": "https://a.example, https://b.example"},
        "shell",
        "-c",
        code,
    )
    assert explicit.stdout.strip().splitlines()[-1] == "['https://a.example', 'https://b.example']"
