"""`.env.example` documents every variable the Compose files read, and nothing else."""

import re
from pathlib import Path

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
