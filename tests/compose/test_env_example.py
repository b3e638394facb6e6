"""`.env.example` documents every variable docker-compose.yml reads, and nothing else."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_env_example_documents_every_compose_variable() -> None:
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", (ROOT / "docker-compose.yml").read_text()))
    documented = set(re.findall(r"^([A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), re.M))
    assert used - documented == set(), "variables docker-compose.yml reads without a line in .env.example"
    assert documented - used == set(), "variables in .env.example that docker-compose.yml ignores"
