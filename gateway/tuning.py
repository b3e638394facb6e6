"""The controller's periodic run: engine telemetry in, each model's ceiling out."""

from __future__ import annotations

import time
from datetime import timedelta

import orjson
from django.utils import timezone

from core.keyspace import controller_key, engine_metrics_key, pool_keys
from core.redis import get_redis
from gateway.controller import ControllerState, Sample, next_ceiling
from gateway.models import AdmissionSample

HISTORY = timedelta(hours=24)


def ready_pools() -> dict[int, tuple[int, list[int]]]:
    """model id -> (static budget, replica ids) for every model with ready replicas."""
    from deployments.choices import DesiredState, ReplicaState
    from deployments.models import Replica

    pools: dict[int, tuple[int, list[int]]] = {}
    ready = Replica.objects.filter(
        state=ReplicaState.READY, healthy=True, deployment__desired_state=DesiredState.RUNNING
    ).select_related("deployment__profile")
    for replica in ready:
        budget, ids = pools.get(replica.deployment.model_id, (0, []))
        pools[replica.deployment.model_id] = (
            budget + replica.deployment.max_num_seqs,
            [*ids, replica.pk],
        )
    return pools


def _totals(replica_ids: list[int]) -> tuple[float, float, float, float] | None:
    """Summed (generation tokens, TTFT seconds sum, TTFT count, waiting) over the replicas."""
    raw = get_redis().mget([engine_metrics_key(rid) for rid in replica_ids])
    figures = [orjson.loads(blob) for blob in raw if blob]
    if not figures:
        return None
    return (
        sum(f.get("generation_tokens_total", 0) for f in figures),
        sum(f.get("ttft_seconds_sum", 0) for f in figures),
        sum(f.get("ttft_count", 0) for f in figures),
        sum(f.get("waiting", 0) for f in figures),
    )


def tune_model(
    model_id: int, budget: int, replica_ids: list[int], now: float | None = None
) -> AdmissionSample | None:
    """One controller tick for one model (a no-op until two telemetry readings exist)."""
    now = time.time() if now is None else now
    client = get_redis()
    totals = _totals(replica_ids)
    if totals is None:
        return None
    state_key = controller_key(model_id)
    previous = client.get(state_key)
    client.set(
        state_key,
        orjson.dumps({"t": now, "totals": totals, "state": _state_of(previous, budget)}),
        ex=3600,
    )
    if previous is None:
        return None
    prev = orjson.loads(previous)
    elapsed = max(now - prev["t"], 1e-3)
    tokens, ttft_sum, ttft_count, waiting = (
        a - b for a, b in zip(totals, prev["totals"], strict=True)
    )
    tokens, ttft_sum, ttft_count = max(tokens, 0), max(ttft_sum, 0), max(ttft_count, 0)
    sample = Sample(
        tokens_per_second=tokens / elapsed,
        ttft_seconds=ttft_sum / ttft_count if ttft_count else None,
        engine_waiting=totals[3],
        gateway_queued=client.zcard(pool_keys(model_id)[1]),
    )
    state = ControllerState(**prev["state"])
    if state.ceiling > budget:  # the replicas changed: the budget is the bound
        state = ControllerState(budget, state.baseline_ttft, state.last_tokens_per_second)
    state, why = next_ceiling(state, sample, budget, preempting=_preempting(replica_ids))
    client.set(pool_keys(model_id)[4], state.ceiling, ex=3600)
    client.set(
        state_key, orjson.dumps({"t": now, "totals": totals, "state": _as_dict(state)}), ex=3600
    )
    return AdmissionSample.objects.create(
        model_id=model_id,
        at=timezone.now(),
        budget=budget,
        ceiling=state.ceiling,
        decision=why,
        tokens_per_second=sample.tokens_per_second,
        ttft_ms=sample.ttft_seconds * 1000 if sample.ttft_seconds is not None else None,
        engine_waiting=sample.engine_waiting,
        gateway_queued=sample.gateway_queued,
    )


def _preempting(replica_ids: list[int]) -> bool:
    """Do all these replicas' engines schedule by priority (vLLM --scheduling-policy)?"""
    from deployments.models import Replica

    replicas = Replica.objects.filter(pk__in=replica_ids).select_related("deployment__profile")
    return bool(replicas) and all(
        r.deployment.effective_args.get("scheduling-policy") == "priority" for r in replicas
    )


def _state_of(previous: bytes | None, budget: int) -> dict:
    if previous is None:
        return _as_dict(ControllerState(ceiling=budget))
    return orjson.loads(previous)["state"]


def _as_dict(state: ControllerState) -> dict:
    return {
        "ceiling": state.ceiling,
        "baseline_ttft": state.baseline_ttft,
        "last_tokens_per_second": state.last_tokens_per_second,
        "last_step": state.last_step,
    }


def tune_all() -> int:
    """Run the controller for every model with ready engines; forget old history."""
    ticks = 0
    for model_id, (budget, replica_ids) in ready_pools().items():
        if tune_model(model_id, budget, replica_ids) is not None:
            ticks += 1
    AdmissionSample.objects.filter(at__lt=timezone.now() - HISTORY).delete()
    return ticks
