"""The controller's periodic run: engine telemetry in, each model's ceiling out, and the
verdict on whether the gateway's preemption frees an engine slot (gateway/controller.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from datetime import timedelta

import orjson
from django.utils import timezone

from core.keyspace import (
    PREEMPT_VERDICT_TTL_SECONDS,
    abort_check_key,
    controller_key,
    engine_metrics_key,
    pool_keys,
    preempt_verdict_key,
)
from core.redis import get_redis
from gateway.controller import (
    ControllerState,
    EngineCount,
    PreemptJudge,
    Sample,
    judge_preemption,
    next_ceiling,
    untracked_slots,
)
from gateway.models import AdmissionSample

log = logging.getLogger("tollgate.gateway")

HISTORY = timedelta(hours=24)
# The stored verdict on the gateway's preemption (AdmissionSample.preemption shows the one
# in force when the sample was taken: "frees", "frees none" or blank).
VERDICTS = {b"1": True, b"0": False}


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


def _figures(replica_ids: list[int]) -> list[dict]:
    """The replicas' latest telemetry (those that have one)."""
    raw = get_redis().mget([engine_metrics_key(rid) for rid in replica_ids])
    return [orjson.loads(blob) for blob in raw if blob]


def _totals(figures: list[dict]) -> tuple[float, float, float, float]:
    """Summed (generation tokens, TTFT seconds sum, TTFT count, waiting) over the replicas."""
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
    figures = _figures(replica_ids)
    if not figures:
        return None
    totals = _totals(figures)
    state_key = controller_key(model_id)
    previous = client.get(state_key)
    prev = orjson.loads(previous) if previous is not None else None
    count = engine_count(figures, len(replica_ids))
    check_idle_engine(model_id, replica_ids, count)
    judge = judge_model(model_id, count, prev)
    client.set(
        state_key,
        orjson.dumps(
            {
                "t": now,
                "totals": totals,
                "state": _state_of(previous, budget),
                "judge": asdict(judge),
            }
        ),
        ex=3600,
    )
    if prev is None:
        return None
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
    state, why = next_ceiling(state, sample, budget)
    verdict = VERDICTS.get(client.get(preempt_verdict_key(model_id)))
    ceiling = max(1, state.ceiling - untracked_slots(judge, count, verdict))
    client.set(pool_keys(model_id)[4], ceiling, ex=3600)
    client.set(
        state_key,
        orjson.dumps(
            {"t": now, "totals": totals, "state": _as_dict(state), "judge": asdict(judge)}
        ),
        ex=3600,
    )
    return AdmissionSample.objects.create(
        model_id=model_id,
        at=timezone.now(),
        budget=budget,
        ceiling=ceiling,
        decision=why,
        tokens_per_second=sample.tokens_per_second,
        ttft_ms=sample.ttft_seconds * 1000 if sample.ttft_seconds is not None else None,
        engine_waiting=sample.engine_waiting,
        gateway_queued=sample.gateway_queued,
        preemption={True: "frees", False: "frees none", None: ""}[verdict],
    )


def engine_count(figures: list[dict], replicas: int) -> EngineCount | None:
    """The engines' running + waiting beside the gateway's slot holders (None unless every
    replica reported both)."""
    if len(figures) < replicas or any("slot_holders" not in f for f in figures):
        return None
    return EngineCount(
        scraped_at=min(f.get("scraped_at", 0) for f in figures),
        engine=sum(f.get("running", 0) + f.get("waiting", 0) for f in figures),
        # Each replica's scrape read them; the most is the lenient figure (fewer false alarms).
        holders=max(f["slot_holders"] for f in figures),
    )


def judge_model(model_id: int, count: EngineCount | None, prev: dict | None) -> PreemptJudge:
    """Judge the model's recent preemptions by its engines' latest count; store a verdict
    (with its TTL) when there is one, and log when it changes. Returns the judge to keep."""
    client = get_redis()
    judge = PreemptJudge(**(prev or {}).get("judge", {}))
    mark = client.hget(pool_keys(model_id)[8], "t")
    preempted_at = int(mark) / 1000 if mark is not None else None
    judge, verdict = judge_preemption(judge, count, preempted_at)
    if verdict is not None:
        store_verdict(model_id, verdict)
    return judge


def store_verdict(model_id: int, frees: bool) -> None:
    """Keep the verdict on the model's preemption (with its TTL) for every gateway process
    and for admission; log when it changes."""
    value = b"1" if frees else b"0"
    note_verdict(model_id, frees)
    key = preempt_verdict_key(model_id)
    if get_redis().set(key, value, ex=PREEMPT_VERDICT_TTL_SECONDS, get=True) == value:
        return
    if frees:
        log.info("model %s: gateway preemption frees an engine slot", model_id)
    else:
        log.warning(
            "model %s: gateway preemption frees no engine slot (the engines go on with the "
            "requests it aborts): off for %d s, the headroom keeps slots for P0 meanwhile",
            model_id,
            PREEMPT_VERDICT_TTL_SECONDS,
        )


def check_idle_engine(model_id: int, replica_ids: list[int], count: EngineCount | None) -> None:
    """With no verdict on the model yet and its engines idle, ask one whether it drops a
    request its client left (deployments/abort_check.py): preemption is then judged before
    it first happens, where asking costs nothing. At most once a minute per model."""
    from deployments.abort_check import engine_drops_abandoned
    from deployments.choices import Task
    from deployments.models import Replica

    if count is None or count.engine or count.holders:
        return
    client = get_redis()
    if client.exists(preempt_verdict_key(model_id)):
        return
    if not client.set(abort_check_key(model_id), 1, nx=True, ex=60):
        return
    replica = (
        Replica.objects.select_related("deployment__model")
        .filter(pk__in=replica_ids, deployment__model__task=Task.GENERATE)
        .first()
    )
    if replica is None:
        return
    deployment = replica.deployment
    key = deployment.upstream_key if deployment.external else ""
    drops = engine_drops_abandoned(
        replica.base_url, deployment.model.served_name, key, replica_id=replica.pk
    )
    log.info(
        "model %s: idle engine asked whether it drops abandoned requests: %s",
        model_id,
        {True: "it does", False: "it does not", None: "no answer"}[drops],
    )
    if drops is not None:
        store_verdict(model_id, drops)


def note_verdict(model_id: int, frees: bool) -> None:
    """Tell admission (acquire.lua) whether preempting is known to free a slot on the model:
    until then it preempts on probation, once per window."""
    preemptions = pool_keys(model_id)[8]
    if not frees:
        get_redis().hdel(preemptions, "frees")
        return
    until_ms = int((time.time() + PREEMPT_VERDICT_TTL_SECONDS) * 1000)
    with get_redis().pipeline() as pipe:
        pipe.hset(preemptions, "frees", until_ms)
        pipe.pexpire(preemptions, 3_600_000)  # as acquire.lua keeps it
        pipe.execute()


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
