"""`.env.example` documents every variable the Compose files read, and nothing else; every
setting the Tollgate processes read reaches them under Compose."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_env_example_documents_every_compose_variable() -> None:
    # compose/node-agent.yml runs on other boxes with its own env file (docs/admins/deployments.md).
    files = [ROOT / "docker-compose.yml", ROOT / "compose/cluster.yml"]
    used = {name for f in files for name in re.findall(r"\$\{([A-Z0-9_]+)", f.read_text())}
    documented = set(re.findall(r"^([A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), re.M))
    assert used - documented == set(), (
        "variables the Compose files read without a line in .env.example"
    )
    assert documented - used == set(), "variables in .env.example that no Compose file reads"


# Read by config/settings.py but never set through Compose's .env: the appliance sets them
# itself (secrets from the state volume, the broker from REDIS_URL, the batch runner's own
# unacknowledged-message keys in compose/entrypoint.sh) or they are for tests.
NOT_FROM_ENV_FILE = {
    "CELERY_BROKER_URL",
    "DJANGO_DEBUG",
    "TOLLGATE_TEST_DATABASE",
    "TOLLGATE_CELERY_UNACKED_KEY",
    "TOLLGATE_TEST_DROP_USAGE_EVERY",  # a test hook, ignored in production
}


def test_every_setting_reaches_the_appliance_processes() -> None:
    """An admin who puts a setting from the settings table (docs/reference/configuration.md) in
    .env sees it take effect."""
    settings_source = (ROOT / "config/settings.py").read_text()
    read = set(re.findall(r'env_[a-z]+\(\s*"([A-Z0-9_]+)"', settings_source))
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service in ("web", "gateway", "worker", "beat", "usage", "batches"):
        environment = compose["services"][service]["environment"]
        missing = read - NOT_FROM_ENV_FILE - set(environment)
        assert missing == set(), f"settings {service} never receives: {sorted(missing)}"
        for name in read & set(environment):
            # Passed through from .env, not pinned: the admin's value wins.
            value = str(environment[name])
            assert f"${{{name}" in value or name in PINNED, f"{service}: {name}={value}"


# Fixed by the appliance's design, whatever .env says.
PINNED = {
    "TOLLGATE_ENV",
    "TOLLGATE_HTTPS",
    "TOLLGATE_TRUST_X_FORWARDED_PROTO",
    "TOLLGATE_DOCKER_URL",
    "TOLLGATE_INTERNAL_URL",
    "TOLLGATE_PLAYGROUND_UPSTREAM",
    "TOLLGATE_IDENTITY",
    "TOLLGATE_UPLOAD_DIR",  # where the adapter-uploads volume is mounted
}


def secret_settings() -> set[str]:
    """Every setting read as a secret (``config/env.py: env_secret``, so also from
    ``<NAME>_FILE``) by Tollgate's code, and the one the entry point reads from a file."""
    names = set()
    for path in ROOT.glob("[a-z]*/**/*.py"):
        if path.parts[len(ROOT.parts)] in {"tests", "bench"}:
            continue
        source = path.read_text()
        names |= set(re.findall(r'env_secret\(\s*"([A-Z0-9_]+)"', source))
        names |= set(
            re.findall(r'_required_in_production\(\s*"([A-Z0-9_]+)",[^)]*secret=True', source)
        )
    entrypoint = (ROOT / "compose/entrypoint.sh").read_text()
    names |= set(re.findall(r"\$\{([A-Z0-9_]+)_FILE:-\}", entrypoint))
    kinds = re.findall(r"use_role_database ([A-Z]+) ", entrypoint)  # its databases' roles
    names |= {f"TOLLGATE_{kind}_DATABASE_URL" for kind in kinds}
    return names - NOT_FROM_ENV_FILE - {"POSTGRES_PASSWORD"}  # keygen's, for the bundled db


TOLLGATE_SERVICES = ("migrate", "web", "gateway", "worker", "beat", "usage", "batches")


def file_receivers(compose: dict) -> dict[str, set[str]]:
    """Which Tollgate services get each ``<NAME>_FILE`` passed through from .env."""
    receivers: dict[str, set[str]] = {}
    for service in TOLLGATE_SERVICES:
        for name, value in compose["services"][service]["environment"].items():
            if name.endswith("_FILE") and f"${{{name}" in str(value):
                receivers.setdefault(name, set()).add(service)
    return receivers


def test_every_secret_can_come_from_a_file_under_compose() -> None:
    """docs/operations/secrets.md: an admin who names a file in .env for any secret sees it
    reach the services that read that secret, and the page's table names those services."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    receivers = file_receivers(compose)
    secrets = secret_settings()
    # The scan finds each kind of place a secret is read: settings, a command, the entrypoint.
    assert {"DJANGO_SECRET_KEY", "TOLLGATE_ADMIN_PASSWORD", "TOLLGATE_APP_DATABASE_URL"} <= secrets
    assert {f"{name}_FILE" for name in secrets} == set(receivers), (
        "secrets whose _FILE variant Compose does not pass (or passes for no secret)"
    )
    page = (ROOT / "docs/operations/secrets.md").read_text()
    table = page.split("| variable | services that read it |", 1)[1].split("\n\n", 1)[0]
    documented: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        names_cell, services_cell = row.strip("|").split("|")
        services = set(re.findall(r"`([a-z]+)`", services_cell.split("(")[0]))
        for name in re.findall(r"`([A-Z0-9_]+)`", names_cell):
            documented[name] = services
    assert documented == receivers
    # A process that never reads a secret is never handed a path to one: beat has no database.
    assert compose["services"]["beat"]["environment"]["DATABASE_URL_FILE"] == ""
