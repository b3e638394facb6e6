"""What the gateway knows, cached in-process: keys, tenants, models, routes, prices and
the models that run on demand.

Loaded from PostgreSQL off the hot path (in a thread) at start-up, after every change
announced on the invalidation channel, and every ``REFRESH_SECONDS`` as a safety net. A
request only ever reads the current ``Snapshot``; no request touches the database.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal

from core.pricing import to_nano


@dataclass(frozen=True, slots=True)
class Limits:
    """Rate limits of one scope (a key or a tenant); 0 means unlimited."""

    rpm: int = 0
    tpm: int = 0
    concurrent: int = 0


@dataclass(frozen=True, slots=True)
class TenantInfo:
    id: int
    slug: str
    priority: str
    boost_until: float  # P0 until this Unix time (0: no boost)
    weight: int  # fair-share weight inside its class
    limits: Limits
    quota_period: str
    quota_tokens: int  # 0: no token quota
    quota_money_nano: int  # 0: no money quota
    currency: str
    model_ids: frozenset[int]
    adapter_ids: frozenset[int] = frozenset()  # the LoRA adapters it may call

    def priority_at(self, now: float) -> str:
        return "P0" if self.boost_until > now else self.priority


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A key that was usable when the snapshot loaded (core.credentials)."""

    id: int  # the key billed and limited: a child key's parent
    prefix: str
    secret_hash: str
    tenant_id: int
    expires_at: float  # Unix seconds, the earlier of its own and its parent's expiry; 0: never
    limits: Limits
    model_ids: frozenset[int]  # empty: all of the tenant's


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A name tenants call: a catalogue model, or a LoRA adapter on one (then ``id`` is its
    base's: the base's engines, slots, routes and limits serve it)."""

    id: int
    served_name: str
    task: str
    context_length: int
    created: int
    adapter_id: int = 0  # 0: the base model itself
    parent: str = ""  # an adapter's base model's served name
    status: str = ""  # an adapter's: ready, checking or failed
    status_message: str = ""
    # Guarded request fields an admin allowed for it (an adapter: its base's): the engine
    # shield (gateway/shield.py) lets them through.
    allowed_fields: frozenset[str] = frozenset()


@dataclass(slots=True)
class Upstream:
    """One ready engine replica. ``outstanding`` is this process's in-flight count."""

    replica_id: int
    deployment_id: int
    base_url: str
    max_num_seqs: int
    auth_header: str = ""  # external engines that expect their own key
    priority_scheduling: bool = False  # vLLM --scheduling-policy priority: its queue by class
    adapter_slots: int = 0  # LoRA adapters it keeps loaded (0: it serves none)
    on_demand: bool = False  # its deployment runs on demand: its use is recorded
    outstanding: int = 0


@dataclass(frozen=True, slots=True)
class DemandInfo:
    """A model's on-demand deployment (gateway/demand.py starts it for a request)."""

    deployment_id: int
    start_timeout: int  # seconds a request waits for a start
    idle_timeout: int  # seconds unused before the worker stops it


@dataclass(frozen=True, slots=True)
class PriceInfo:
    """A price version, in nano-units of its currency per 1M tokens (exact integers): a
    ``core.pricing.NanoRates``."""

    id: int
    input_nano_per_mtok: int
    cached_nano_per_mtok: int
    output_nano_per_mtok: int
    effective_from: float


@dataclass(slots=True)
class Snapshot:
    keys: dict[str, KeyInfo] = field(default_factory=dict)
    tenants: dict[int, TenantInfo] = field(default_factory=dict)
    models: dict[str, ModelInfo] = field(default_factory=dict)
    routes: dict[int, list[Upstream]] = field(default_factory=dict)
    prices: dict[tuple[int, str], list[PriceInfo]] = field(default_factory=dict)
    adapter_prices: dict[tuple[int, str], list[PriceInfo]] = field(default_factory=dict)
    demand: dict[int, DemandInfo] = field(default_factory=dict)  # by model id
    loaded_at: float = 0.0

    def price_for(self, model: ModelInfo, currency: str, at: float) -> PriceInfo | None:
        """The price in force for a call of ``model``: an adapter's own, else its base's."""
        if model.adapter_id:
            for price in self.adapter_prices.get((model.adapter_id, currency), ()):
                if price.effective_from <= at:
                    return price
        return self.price_at(model.id, currency, at)

    def price_at(self, model_id: int, currency: str, at: float) -> PriceInfo | None:
        """The price version in force at ``at`` (versions are sorted newest first)."""
        for price in self.prices.get((model_id, currency), ()):
            if price.effective_from <= at:
                return price
        return None


def _ts(value: datetime | None) -> float:
    return value.timestamp() if value else 0.0


def _limits(obj: object) -> Limits:
    return Limits(
        rpm=obj.requests_per_minute or 0,
        tpm=obj.tokens_per_minute or 0,
        concurrent=obj.max_concurrent_requests or 0,
    )


def _nano(amount: Decimal | None) -> int:
    return to_nano(amount) if amount is not None else 0


def load_snapshot(previous: Snapshot | None = None) -> Snapshot:
    """Read everything the gateway needs in a handful of queries (runs in a thread)."""
    snap = Snapshot(loaded_at=time.time())
    _load_models(snap)
    _load_adapters(snap)
    _load_tenants(snap)
    _load_keys(snap)
    _load_routes(snap, previous)
    _load_demand(snap)
    _load_prices(snap)
    return snap


def load_routes() -> dict[int, list[Upstream]]:
    """Every model's ready replicas, by model id (alone: for the orphan reaper's counting)."""
    snap = Snapshot(loaded_at=time.time())
    _load_routes(snap, None)
    return snap.routes


def _load_models(snap: Snapshot) -> None:
    from deployments.models import CatalogModel

    for model in CatalogModel.objects.all():
        snap.models[model.served_name] = ModelInfo(
            id=model.pk,
            served_name=model.served_name,
            task=model.task,
            context_length=model.context_length,
            created=int(model.created_at.timestamp()),
            allowed_fields=frozenset(model.allowed_request_fields),
        )


def _load_adapters(snap: Snapshot) -> None:
    from deployments.models import Adapter

    for adapter in Adapter.objects.select_related("base"):
        if adapter.served_name in snap.models:
            continue  # a model of that name came first (the services refuse such clashes)
        base = adapter.base
        snap.models[adapter.served_name] = ModelInfo(
            id=base.pk,
            served_name=adapter.served_name,
            task=base.task,
            context_length=base.context_length,
            created=int(adapter.created_at.timestamp()),
            adapter_id=adapter.pk,
            parent=base.served_name,
            status=adapter.status,
            status_message=adapter.status_message,
            allowed_fields=frozenset(base.allowed_request_fields),
        )


def _load_tenants(snap: Snapshot) -> None:
    from deployments.access import adapters_for_tenant, models_for_tenant
    from tenants.models import Tenant

    for tenant in Tenant.objects.all():
        snap.tenants[tenant.pk] = TenantInfo(
            id=tenant.pk,
            slug=tenant.slug,
            priority=tenant.priority,
            boost_until=_ts(tenant.priority_boost_until),
            weight=tenant.fair_share_weight,
            limits=_limits(tenant),
            quota_period=tenant.quota_period,
            quota_tokens=tenant.quota_tokens or 0,
            quota_money_nano=_nano(tenant.quota_amount),
            currency=tenant.currency,
            model_ids=frozenset(models_for_tenant(tenant).values_list("pk", flat=True)),
            adapter_ids=frozenset(adapters_for_tenant(tenant).values_list("pk", flat=True)),
        )


def _load_keys(snap: Snapshot) -> None:
    from tenants.models import ApiKey

    keys = (
        ApiKey.objects.usable()
        .select_related("parent")
        .prefetch_related("allowed_models", "parent__allowed_models")
    )
    for key in keys:
        # A child key acts as its parent (limits, models, billing).
        acting = key.parent or key
        expiry = min(filter(None, [_ts(key.expires_at), _ts(acting.expires_at)]), default=0.0)
        snap.keys[key.prefix] = KeyInfo(
            id=acting.pk,
            prefix=key.prefix,
            secret_hash=key.secret_hash,
            tenant_id=key.tenant_id,
            expires_at=expiry,
            limits=_limits(acting),
            model_ids=frozenset(m.pk for m in acting.allowed_models.all()),
        )


def _load_routes(snap: Snapshot, previous: Snapshot | None) -> None:
    from deployments.choices import DeploymentMode, DesiredState, ReplicaState
    from deployments.models import Replica

    # A replica that stays as it was keeps its Upstream object: the requests in flight on it
    # decrement that object when they end, so its count stays true across reloads (a copy of
    # the count would keep them forever). A changed one starts afresh at 0.
    old = {u.replica_id: u for ups in (previous.routes.values() if previous else ()) for u in ups}
    replicas = Replica.objects.filter(
        state=ReplicaState.READY, healthy=True, deployment__desired_state=DesiredState.RUNNING
    ).select_related("deployment__profile")
    for replica in replicas:
        if not replica.base_url:
            continue
        upstream = Upstream(
            replica_id=replica.pk,
            deployment_id=replica.deployment_id,
            base_url=replica.base_url,
            max_num_seqs=replica.deployment.max_num_seqs,
            priority_scheduling=replica.deployment.effective_args.get("scheduling-policy")
            == "priority",
            auth_header=f"Bearer {replica.deployment.upstream_key}"
            if replica.deployment.upstream_key
            else "",
            adapter_slots=replica.deployment.adapter_slots
            if replica.deployment.serves_adapters
            else 0,
            on_demand=replica.deployment.mode == DeploymentMode.ON_DEMAND,
        )
        kept = old.get(replica.pk)
        if kept is not None and replace(kept, outstanding=0) == upstream:
            upstream = kept
        snap.routes.setdefault(replica.deployment.model_id, []).append(upstream)


def _load_demand(snap: Snapshot) -> None:
    """Each model's on-demand deployment Tollgate starts (the first by name, if several)."""
    from deployments.choices import DeploymentMode, DesiredState
    from deployments.models import Deployment

    rows = (
        Deployment.objects.filter(
            mode=DeploymentMode.ON_DEMAND, desired_state=DesiredState.RUNNING, external=False
        )
        .order_by("name")
        .values_list("pk", "model_id", "start_timeout_seconds", "idle_timeout_seconds")
    )
    for pk, model_id, start_timeout, idle_timeout in rows:
        snap.demand.setdefault(model_id, DemandInfo(pk, start_timeout, idle_timeout))


def _load_prices(snap: Snapshot) -> None:
    from metering.models import Price

    for price in Price.objects.order_by("model_id", "currency", "-effective_from"):
        if price.adapter_id:
            table, owner = snap.adapter_prices, price.adapter_id
        else:
            table, owner = snap.prices, price.model_id
        table.setdefault((owner, price.currency), []).append(
            PriceInfo(
                id=price.pk,
                input_nano_per_mtok=_nano(price.input_per_mtok),
                cached_nano_per_mtok=_nano(price.cached_input_per_mtok),
                output_nano_per_mtok=_nano(price.output_per_mtok),
                effective_from=price.effective_from.timestamp(),
            )
        )
