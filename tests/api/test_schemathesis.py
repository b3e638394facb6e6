"""A property-based run of the OpenAPI schema against the live admin API (Schemathesis).

Django's live server serves the test database holding ``world`` (both tenants' objects), and
the ``schemathesis`` command — the one docs/reference/admin-api.md gives — fuzzes every operation of
``/api/schema/`` with a platform admin's token: no answer may be a 5xx, an undocumented
status or content type, or a body or header that breaks the schema, and every method an
operation does not document must be a 405.

Bounded for CI: ``SCHEMATHESIS_MAX_EXAMPLES`` examples per operation (default 5), and
deterministic: the generator's seed is ``SCHEMATHESIS_SEED`` (default fixed, so a commit's run
is the same run every time; ``SCHEMATHESIS_SEED=random`` explores new cases and prints the
seed it drew, which reproduces them).
``POST /api/v1/tokens/{id}/revoke/`` is left out: it may revoke the run's own token, and every
later answer would be a 401.
"""

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from tenants import services
from tests.api.conftest import World

DEFAULT_SEED = "20261126"
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "unsupported_method",
]


def test_schemathesis_finds_no_server_error_and_no_schema_breaking_answer(
    world: World, live_server: Any, tmp_path: Path, settings: Any
) -> None:
    token = services.issue_admin_token(world.root, name="schemathesis").plaintext
    examples = os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "5")
    seed = os.environ.get("SCHEMATHESIS_SEED", DEFAULT_SEED)
    if seed == "random":
        seed = str(random.SystemRandom().randrange(2**32))
    print(f"[schemathesis] --seed {seed} --max-examples {examples}")
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{live_server.url}/api/schema/?format=json",
        "--header",
        f"Authorization: Bearer {token}",
        "--phases",
        "fuzzing",
        "--max-examples",
        examples,
        "--checks",
        ",".join(CHECKS),
        "--exclude-path-regex",
        r"tokens/\{id\}/revoke",
        "--seed",
        seed,
        "--no-color",
    ]
    run = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, f"seed {seed}\n" + report[-12000:]
    assert "Server error" not in report
    tested = [line for line in report.splitlines() if line.strip().startswith("Tested:")]
    assert tested and int(tested[0].split()[-1]) > 70, report[-3000:]  # every operation ran
