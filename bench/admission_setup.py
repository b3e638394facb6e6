"""Rows for bench/admission_bench.py in its own database, and the priority switch between runs.

``create PORT [fcfs|priority]``: one model served by one simulator replica whose deployment
says ``max-num-seqs 4`` and the scheduling policy (default priority; so the gateway's static
budget is 4), and four tenants with no limits and no quota — ``interactive`` (P0), ``batch``
(P2), ``fair-a`` and ``fair-b`` (P1, weight 1 each) — with one key each. Prints JSON: keys,
tenant ids, model and replica id.

``priorities SLUG=CLASS …``: change tenants' classes through the service layer (which
announces the change, so the gateway reloads within a second).

``samples AFTER``: the controller's ticks (``gateway.models.AdmissionSample`` rows beat's
``gateway.tune_admission`` wrote) with a primary key above AFTER, oldest first, as JSON:
``{"last": <greatest pk>, "ticks": [{"at", "ceiling", "decision", …}, …]}`` — what a bench
running the whole appliance reads instead of bench/admission_ticker.py's lines.

    DATABASE_URL=… .venv/bin/python bench/admission_setup.py create 8001
    DATABASE_URL=… .venv/bin/python bench/admission_setup.py priorities interactive=P1 batch=P1
    DATABASE_URL=… .venv/bin/python bench/admission_setup.py samples 0
"""

from __future__ import annotations

import json
import os
import sys
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
TENANTS = {"interactive": ("P0", 1), "batch": ("P2", 1), "fair-a": ("P1", 1), "fair-b": ("P1", 1)}
UNLIMITED = {
    "requests_per_minute": None,
    "tokens_per_minute": None,
    "max_concurrent_requests": None,
}


def _django() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()


def create(port: int, policy: str = "priority") -> dict:
    from deployments import services as deployment_services
    from deployments.choices import ReplicaState
    from deployments.models import Deployment, Replica
    from tenants import services as tenant_services

    node = deployment_services.register_node(
        None, name="admbench-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    model = deployment_services.create_model(
        None,
        served_name=MODEL,
        source=f"sim/{MODEL}",
        task="generate",
        params_billions=Decimal("8"),
        context_length=4096,
        visibility="public",
    )
    deployment = Deployment.objects.create(
        name=f"{MODEL}-dep",
        model=model,
        node=node,
        image="tollgate/engine-sim:latest",
        engine_args={"max-num-seqs": 4, "scheduling-policy": policy},
        desired_state="running",
        state="ready",
    )
    replica = Replica.objects.create(
        deployment=deployment,
        index=0,
        node=node,
        host="127.0.0.1",
        port=port,
        state=ReplicaState.READY,
        healthy=True,
    )
    keys, ids = {}, {}
    for slug, (priority, weight) in TENANTS.items():
        tenant = tenant_services.create_tenant(
            None,
            name=slug,
            slug=slug,
            priority=priority,
            fair_share_weight=weight,
            quota_tokens=None,
            **UNLIMITED,
        )
        keys[slug] = tenant_services.issue_api_key(None, tenant, name=slug, **UNLIMITED).plaintext
        ids[slug] = tenant.pk
    return {
        "keys": keys,
        "tenant_ids": ids,
        "model_id": model.pk,
        "replica_id": replica.pk,
        "budget": deployment.max_num_seqs,
    }


def priorities(changes: dict[str, str]) -> dict:
    from tenants import services as tenant_services
    from tenants.models import Tenant

    for slug, priority in changes.items():
        tenant_services.update_tenant(None, Tenant.objects.get(slug=slug), priority=priority)
    return {slug: t.priority for slug, t in ((t.slug, t) for t in Tenant.objects.all())}


def tick(s: object) -> dict:
    """One controller tick (an AdmissionSample) as the benches read it."""
    return {
        "at": s.at.timestamp(),
        "ceiling": s.ceiling,
        "decision": s.decision,
        "tok_s": round(s.tokens_per_second, 1),
        "ttft_ms": round(s.ttft_ms, 1) if s.ttft_ms is not None else None,
        "engine_waiting": s.engine_waiting,
        "queued": s.gateway_queued,
        "preemption": s.preemption,
    }


def samples(after: int) -> dict:
    from gateway.models import AdmissionSample

    rows = AdmissionSample.objects.filter(pk__gt=after).order_by("pk")
    ticks = [tick(s) for s in rows]
    last = AdmissionSample.objects.order_by("-pk").values_list("pk", flat=True).first()
    return {"last": last or after, "ticks": ticks}


if __name__ == "__main__":
    _django()
    command, *args = sys.argv[1:]
    if command == "create":
        print(json.dumps(create(int(args[0]), *args[1:])))
    elif command == "samples":
        print(json.dumps(samples(int(args[0]))))
    else:
        print(json.dumps(priorities(dict(a.split("=") for a in args))))
