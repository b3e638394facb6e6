"""Rows for bench/gateway_bench.py in its own database: a tenant, a key, models, prices, routes.

Run with the bench's DATABASE_URL (after ``manage.py migrate``); prints the key's
plaintext as JSON. Rate limits stay ON but far above what the bench sends, so every
request pays the full Lua admission and settlement (windows, concurrency sets, quota);
the price makes metering compute money for every usage event.

    DATABASE_URL=… .venv/bin/python bench/gateway_setup.py MODEL=PORT [MODEL=PORT …]
"""

from __future__ import annotations

import json
import os
import sys
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIGH = 1_000_000_000  # requests or tokens per minute: never reached by the bench


def main(routes: dict[str, int]) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from deployments import services as deployment_services
    from deployments.choices import ReplicaState
    from deployments.models import Deployment, Replica
    from metering import services as metering_services
    from tenants import services as tenant_services

    node = deployment_services.register_node(
        None, name="bench-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    tenant = tenant_services.create_tenant(
        None,
        name="Bench",
        slug="bench",
        requests_per_minute=HIGH,
        tokens_per_minute=HIGH,
        max_concurrent_requests=100_000,
        quota_tokens=10**15,
    )
    for name, port in routes.items():
        model = deployment_services.create_model(
            None,
            served_name=name,
            source=f"sim/{name}",
            task="generate",
            params_billions=Decimal("1"),
            context_length=4096,
            visibility="public",
        )
        metering_services.set_price(None, model, Decimal("1.00"), Decimal("0.50"), Decimal("2.00"))
        deployment = Deployment.objects.create(
            name=f"{name}-dep",
            model=model,
            node=node,
            image="tollgate/engine-sim:latest",
            engine_args={"max-num-seqs": 4096},
            desired_state="running",
            state="ready",
        )
        Replica.objects.create(
            deployment=deployment,
            index=0,
            node=node,
            host="127.0.0.1",
            port=port,
            state=ReplicaState.READY,
            healthy=True,
        )
    key = tenant_services.issue_api_key(
        None,
        tenant,
        name="bench",
        requests_per_minute=HIGH,
        tokens_per_minute=HIGH,
        max_concurrent_requests=100_000,
    )
    print(json.dumps({"key": key.plaintext}))


if __name__ == "__main__":
    main({name: int(port) for name, port in (arg.split("=") for arg in sys.argv[1:])})
