"""Loading tenants' LoRA adapters into the engines of their base, on the worker.

vLLM loads an adapter at run time (``POST /v1/load_lora_adapter`` with the flag
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, which Tollgate sets); it keeps
up to ``--max-cpu-loras`` of them ready (default ``--max-loras``) and reads any other
from disk again on every swap. So each replica holds at most that many: loading one more
first unloads the least recently used (the gateway records each use). What a replica holds
is kept in Redis (core.keyspace.lora_keys), where every gateway process reads it to route
an adapter's requests to a replica that has it, and asks for a load (the task
``deployments.load_adapter``) when none has. A replica that starts again (a crash, a
restart) is given back what it held, and the pinned adapters, before it is marked ready.

One worker at a time changes a replica's adapters (a Redis lock per replica).
"""

from __future__ import annotations

import logging
import time

import httpx

from core.changes import publish_change
from core.keyspace import lora_keys, lora_lock_key, lora_want_key
from core.redis import get_redis
from deployments.choices import AdapterStatus, ReplicaState
from deployments.models import Adapter, Deployment, Replica

log = logging.getLogger(__name__)

LOCK_SECONDS = 120  # the longest one replica's change may hold its lock
FAILURE_SECONDS = 30  # how long a failed load's reason stays for waiting requests to read
RECENT_MS = 2000  # an adapter used this recently is unloaded only when no other can be


class AdapterLoadFailed(Exception):
    """The engine refused an adapter (or could not be reached); the message says why."""


def loaded(replica_id: int) -> dict[int, str]:
    """The adapters a replica holds: id -> served name."""
    raw = get_redis().hgetall(lora_keys(replica_id)[0])
    return {int(k): v.decode() if isinstance(v, bytes) else v for k, v in raw.items()}


def load_by_ids(adapter_id: int, replica_id: int) -> None:
    """The task's body: load one adapter into one replica, recording a failure's reason."""
    r = get_redis()
    try:
        adapter = Adapter.objects.select_related("base").get(pk=adapter_id)
        replica = Replica.objects.select_related("deployment__profile").get(pk=replica_id)
        load(adapter, replica)
    except (Adapter.DoesNotExist, Replica.DoesNotExist):
        log.info("adapter %s or replica %s is gone: nothing to load", adapter_id, replica_id)
    except AdapterLoadFailed as exc:
        _failed(replica_id, adapter_id, str(exc))
    finally:
        r.delete(lora_want_key(replica_id, adapter_id))


def load(adapter: Adapter, replica: Replica) -> None:
    """Load ``adapter`` into ``replica``, unloading the least recently used first when the
    replica is full. Asked for one the record says it holds, the engine is asked anyway (it
    answers "already loaded" if so): an engine that lost it (a restart the record missed, an
    unload by hand) is given it back, and the gateway that asked stops meeting 404s."""
    deployment = replica.deployment
    _check_fits(adapter, deployment)
    with get_redis().lock(lora_lock_key(replica.pk), timeout=LOCK_SECONDS, blocking_timeout=60):
        held = loaded(replica.pk)
        if adapter.pk not in held:
            for victim in _victims(replica.pk, held, deployment.adapter_slots - 1):
                unload_from(replica, victim, held[victim])
        _post(replica, "/v1/load_lora_adapter", adapter.served_name, adapter.source)
        _mark_loaded(replica.pk, adapter)
    log.info("adapter %s loaded into replica %s", adapter, replica.pk)


def _check_fits(adapter: Adapter, deployment: Deployment) -> None:
    if adapter.base_id != deployment.model_id:
        raise AdapterLoadFailed(
            f"{adapter} is an adapter of {adapter.base}, not of {deployment.model}."
        )
    if not deployment.serves_adapters:
        raise AdapterLoadFailed(f"The deployment {deployment} does not serve adapters.")
    if adapter.status != AdapterStatus.READY:
        reason = adapter.status_message or "its files are still being checked"
        raise AdapterLoadFailed(f"The adapter {adapter} is not ready: {reason}")
    if adapter.rank and adapter.rank > deployment.max_lora_rank:
        raise AdapterLoadFailed(
            f"The adapter {adapter} has rank {adapter.rank}; {deployment} serves ranks up to "
            f"{deployment.max_lora_rank} (--max-lora-rank)."
        )


def _victims(replica_id: int, held: dict[int, str], room: int) -> list[int]:
    """Which held adapters to unload so that at most ``room`` stay: the least recently used,
    pinned ones and those used in the last moments only when nothing else can go."""
    excess = len(held) - max(room, 0)
    if excess <= 0:
        return []
    used = dict(get_redis().zrange(lora_keys(replica_id)[1], 0, -1, withscores=True))
    last = {a: used.get(str(a).encode(), used.get(str(a), 0.0)) for a in held}
    pinned = set(Adapter.objects.filter(pk__in=held, pinned=True).values_list("pk", flat=True))
    now = time.time() * 1000
    order = sorted(held, key=lambda a: (a in pinned, now - last[a] < RECENT_MS, last[a]))
    return order[:excess]


def unload_from(replica: Replica, adapter_id: int, served_name: str) -> None:
    """Unload one adapter from a replica (already gone from the engine counts as done)."""
    try:
        _post(replica, "/v1/unload_lora_adapter", served_name)
    except AdapterLoadFailed as exc:
        if "cannot be found" not in str(exc):
            raise
    r = get_redis()
    held, used, _err = lora_keys(replica.pk)
    r.hdel(held, adapter_id)
    r.zrem(used, adapter_id)
    publish_change("lora", replica.pk)
    log.info("adapter %s unloaded from replica %s", served_name, replica.pk)


def _mark_loaded(replica_id: int, adapter: Adapter) -> None:
    r = get_redis()
    held, used, err = lora_keys(replica_id)
    pipe = r.pipeline()
    pipe.hset(held, adapter.pk, adapter.served_name)
    pipe.zadd(used, {adapter.pk: time.time() * 1000})
    pipe.hdel(err, adapter.pk)
    pipe.execute()
    publish_change("lora", replica_id)


def _failed(replica_id: int, adapter_id: int, reason: str) -> None:
    r = get_redis()
    err = lora_keys(replica_id)[2]
    r.hset(err, adapter_id, reason)
    r.expire(err, FAILURE_SECONDS)
    publish_change("lora", replica_id)
    log.warning(
        "adapter %s could not be loaded into replica %s: %s", adapter_id, replica_id, reason
    )


def _post(replica: Replica, path: str, name: str, source: str | None = None) -> None:
    body = {"lora_name": name} if source is None else {"lora_name": name, "lora_path": source}
    deployment = replica.deployment
    headers = (
        {"Authorization": f"Bearer {deployment.upstream_key}"} if deployment.upstream_key else {}
    )
    try:
        answer = httpx.post(f"{replica.base_url}{path}", json=body, headers=headers, timeout=120)
    except httpx.HTTPError as exc:
        raise AdapterLoadFailed(
            f"The engine of replica {replica.pk} could not be reached: {exc}"
        ) from exc
    if answer.status_code == 200:
        return
    if answer.status_code == 400 and "already" in answer.text:
        return  # loaded by an earlier, interrupted run: the engine has it
    raise AdapterLoadFailed(f"The engine answered {answer.status_code}: {_message(answer)}")


def _message(answer: httpx.Response) -> str:
    try:
        body = answer.json()
    except ValueError:
        return answer.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))[:500]
    return str(body)[:500]


def restore(replica: Replica) -> list[str]:
    """Give a replica that (re)started what it held before and its base's pinned adapters
    (up to its slots); the reasons of those that failed."""
    deployment = replica.deployment
    if not deployment.serves_adapters:
        return []
    before = loaded(replica.pk)
    r = get_redis()
    r.delete(lora_keys(replica.pk)[0])  # a new engine holds nothing
    pinned = Adapter.objects.filter(base=deployment.model, pinned=True, status=AdapterStatus.READY)
    wanted = [a.pk for a in pinned] + [a for a in before if a not in {p.pk for p in pinned}]
    adapters = Adapter.objects.in_bulk(wanted[: deployment.adapter_slots])
    failures = []
    for pk in wanted[: deployment.adapter_slots]:
        adapter = adapters.get(pk)
        if adapter is None:
            continue
        try:
            load(adapter, replica)
        except AdapterLoadFailed as exc:
            failures.append(f"{adapter}: {exc}")
    return failures


def forget(replica_id: int) -> None:
    """A replica stopped: it holds nothing (its usage history is dropped too)."""
    get_redis().delete(*lora_keys(replica_id))
    publish_change("lora", replica_id)


def unload_everywhere(base_id: int, adapter_id: int) -> None:
    """Take an adapter out of every engine of its base holding it (deleted, or its files
    changed: the next request loads them again)."""
    replicas = Replica.objects.filter(deployment__model_id=base_id, state=ReplicaState.READY)
    for replica in replicas.select_related("deployment__profile"):
        with get_redis().lock(lora_lock_key(replica.pk), timeout=LOCK_SECONDS, blocking_timeout=60):
            held = loaded(replica.pk)
            if adapter_id not in held:
                continue
            try:
                unload_from(replica, adapter_id, held[adapter_id])
            except AdapterLoadFailed as exc:
                log.warning("could not unload %s from replica %s: %s", adapter_id, replica.pk, exc)
