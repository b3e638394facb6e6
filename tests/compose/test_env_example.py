"""`.env.example` documents every variable the Compose files read, and nothing else; every
setting the Tollgate processes read reaches them under Compose."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_env_example_documents_every_compose_variable() -> None:
    # compose/node-agent.yml runs on other boxes with its own env file (deployments/README.md).
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
}


def test_every_setting_reaches_the_appliance_processes() -> None:
    """An admin who puts a setting from README's table in .env sees it take effect."""
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
}
