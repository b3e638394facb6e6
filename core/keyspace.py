"""Every Redis key and pub/sub channel the planes share, named in one place.

All names live under ``TOLLGATE_REDIS_PREFIX`` (``<prefix>:<part>:…``), so installations
and test runs can share one Redis. Money is in integer nano-units (``core.pricing``).

Rate limits and quotas: written by the gateway's admit and settle scripts
(gateway/limiter.lua, gateway/settle.lua); the quota hash is reconciled by metering.

- ``rl:k:<key id>`` / ``rl:t:<tenant id>``: a key's / tenant's request window, a zset
  (request id -> admission time, ms); ``…:t`` beside each is its token window, a hash
  (request id -> tokens, ``_sum`` -> their total).
- ``cc:k:<key id>`` / ``cc:t:<tenant id>``: requests in flight, a zset (request id ->
  deadline, ms).
- ``quota:<tenant id>:<period id>``: a hash of ``tokens_used``, ``money_used`` (settled)
  and ``tokens_reserved``, ``money_reserved`` (in flight); kept ``QUOTA_TTL_SECONDS``.

Requests in flight: written at admission, settled by the gateway or, when its process
died, by the orphan reaper (gateway/orphans.py).

- ``gw:open``: a zset (request id -> lease deadline, ms); ``gw:open:rec``: a hash (request
  id -> what settling needs, JSON); ``gw:open:cp``: a hash (request id -> tokens delivered
  so far, ``prompt,completion,cached,reasoning``).
- ``settled:<request id>``: settle.lua's mark that a request is settled, so a retried
  settle is a no-op.

Usage: ``usage:events``, the stream the gateway appends one ``core.usage.UsageRecord`` per
request to and metering's consumer group reads.

Stored responses (gateway/response_store.py): ``resp:<tenant id>:<response id>``, a kept
``/v1/responses`` answer (JSON; ``-`` marks one deleted), with a TTL: PostgreSQL keeps them
for good; ``responses:log``, the stream of puts and deletes its consumer writes there.

Admission (gateway/admission.py and its Lua; the console reads it through
``gateway.admission.pool_status`` and ``wait_stats``):

- ``adm:<model id>:run``: requests holding an engine slot (request id -> lease deadline,
  ms); ``…:q``: the queue (request id -> rank, an encoding private to the admission
  scripts); ``…:qexp``: when each waiter gives up (ms); ``…:vft``: fair-share virtual
  times; ``…:ceiling``: the adaptive concurrency ceiling; ``…:tok``: what the slot holders
  hold (request id -> predicted tokens × 4 + class, ``_tok`` their total, ``_c0``/``_c1``/
  ``_c2`` holders by class); ``…:hi``: recent higher-class demand (the headroom lower
  classes leave free); ``…:pre``: preemptible slot holders; ``…:preempted``: the gateway's
  preemptions on the model (``t`` the last one's time, ms), written by
  acquire.lua and judged by the controller (``frees``: until when, ms, its verdict "it
  does" holds, for acquire.lua); ``…:ctl``: the controller's last reading
  (gateway/tuning.py); ``…:pfree``: its verdict on whether preempting frees an engine slot
  (``1``/``0``, kept ``PREEMPT_VERDICT_TTL_SECONDS``), read by every gateway process;
  ``…:abortcheck``: set while an idle engine of the model was recently asked whether it drops
  a request its client left (deployments/abort_check.py), so it is asked once a minute at
  most.
- ``adm:waits:<hour>``: queue waits of one UTC hour (hours since the epoch), a hash.
- ``adm:wake``: channel; the payload is a model id whose engine slot was freed.

Routing (gateway/routing.py and route.lua): ``route:<model id>`` (an adapter's:
``route:<base id>.<adapter id>``), a hash (prefix digest ->
the replica that last served it) and ``route:<model id>:lru`` (prefix digest -> last use,
ms), bounded by dropping the least recently used.

Engines: ``engine:<replica id>:metrics``, the telemetry the worker scrapes (JSON, short
TTL), read by the gateway's admission and its controller; ``engine:<replica id>:own``,
Tollgate's own requests' tokens, and ``engine:<replica id>:ledger``, the state of the bill's
check against the engine (metering/engine_ledger.py), whose figures for /metrics are in the
hash ``ledger:stats``.

Adapters (deployments/adapter_loading.py writes, the gateway reads): ``lora:<replica id>``,
a hash (adapter id -> its served name) of the LoRA adapters loaded in that engine;
``lora:<replica id>:used``, a zset (adapter id -> last use, ms) the gateway keeps, for the
worker's least-recently-used unloading; ``lora:<replica id>:err``, a hash (adapter id -> why
its last load failed), short-lived; ``lora:<replica id>:want:<adapter id>``, set while a load
is queued, so many waiting requests queue one; ``lora:<replica id>:lock``, the worker's lock.

Changes: ``gateway:invalidate``, channel; ``core.changes.publish_change`` announces that a
tenant, key, model, price, deployment or replica changed, and gateway processes reload.

Keys private to one app (deployments' operation leases, reconcile locks and engine log
tails) are built with ``rkey`` where they are used.
"""

from functools import lru_cache

from core.hot import setting

PREFIX_SETTING = "TOLLGATE_REDIS_PREFIX"

# A verdict on gateway preemption lapses after this: preemption is then tried (and judged)
# again, in case the engine changed.
PREEMPT_VERDICT_TTL_SECONDS = 600

# A quota hash outlives the longest (monthly) period.
QUOTA_TTL_SECONDS = 40 * 24 * 3600


def rkey(*parts: object) -> str:
    """A Redis key in Tollgate's namespace: ``<prefix>:<part>:<part>…``."""
    return ":".join([setting(PREFIX_SETTING), *map(str, parts)])


def rate_keys(key_id: int, tenant_id: int) -> tuple[str, str, str, str, str, str]:
    """(key requests, key tokens, tenant requests, tenant tokens, key in flight, tenant in
    flight): the order of limiter.lua's KEYS 1-6."""
    return (
        rkey("rl", "k", key_id),
        rkey("rl", "k", key_id, "t"),
        rkey("rl", "t", tenant_id),
        rkey("rl", "t", tenant_id, "t"),
        rkey("cc", "k", key_id),
        rkey("cc", "t", tenant_id),
    )


def quota_key(tenant_id: int, period_id: str) -> str:
    """A tenant's quota hash for one period (``metering.periods.period_id``)."""
    return rkey("quota", tenant_id, period_id)


def open_keys() -> tuple[str, str, str]:
    """(open requests zset, their records hash, delivered-token checkpoints hash)."""
    return _open_keys(setting(PREFIX_SETTING))


@lru_cache(maxsize=16)
def _open_keys(prefix: str) -> tuple[str, str, str]:  # cached per prefix (tests change it)
    return rkey("gw", "open"), rkey("gw", "open", "rec"), rkey("gw", "open", "cp")


def settled_stem() -> str:
    """``<stem><request id>`` marks a settled request."""
    return rkey("settled", "")


def usage_stream() -> str:
    """The Redis stream of usage events."""
    return rkey("usage", "events")


def stored_response_key(tenant_id: int, response_id: str) -> str:
    """A tenant's kept response (the write-through copy of gateway.models.StoredResponse)."""
    return rkey("resp", tenant_id, response_id)


def responses_log() -> str:
    """The stream of stored-response puts and deletes, persisted to PostgreSQL."""
    return rkey("responses", "log")


PoolKeys = tuple[str, str, str, str, str, str, str, str, str]


def pool_keys(model_id: int) -> PoolKeys:
    """(running, queue, queue expiry, fair share, ceiling, in-flight tokens, recent demand,
    preemptible slot holders, preemptions) of a model's engine pool: the order of
    acquire.lua's pool."""
    return _pool_keys(setting(PREFIX_SETTING), model_id)


@lru_cache(maxsize=4096)
def _pool_keys(prefix: str, model_id: int) -> PoolKeys:
    base = ("adm", model_id)
    return (
        rkey(*base, "run"),
        rkey(*base, "q"),
        rkey(*base, "qexp"),
        rkey(*base, "vft"),
        rkey(*base, "ceiling"),
        rkey(*base, "tok"),
        rkey(*base, "hi"),
        rkey(*base, "pre"),
        rkey(*base, "preempted"),
    )


def route_keys(model_id: int | str) -> tuple[str, str]:
    """(prefix table, its recency) of a model's prefix-aware routing."""
    return _route_keys(setting(PREFIX_SETTING), model_id)


@lru_cache(maxsize=4096)
def _route_keys(prefix: str, model_id: int | str) -> tuple[str, str]:
    return rkey("route", model_id), rkey("route", model_id, "lru")


def controller_key(model_id: int) -> str:
    """The admission controller's last reading of a model's engines."""
    return rkey("adm", model_id, "ctl")


def preempt_verdict_key(model_id: int) -> str:
    """The controller's verdict on a model: does the gateway's preemption free an engine
    slot there (``1``), or do its engines finish the abandoned request anyway (``0``)?"""
    return rkey("adm", model_id, "pfree")


def abort_check_key(model_id: int) -> str:
    """Set (with a TTL) while a model's idle engine was recently asked whether it drops a
    request its client left."""
    return rkey("adm", model_id, "abortcheck")


def wait_stats_key(hour: int) -> str:
    """Queue-wait statistics of one UTC hour (hours since the epoch)."""
    return rkey("adm", "waits", hour)


def wake_channel() -> str:
    """Channel: an engine slot of the model (the payload, its id) was freed."""
    return rkey("adm", "wake")


def lora_keys(replica_id: int) -> tuple[str, str, str]:
    """(adapters loaded, their last use, their last load failures) of an engine replica."""
    base = ("lora", replica_id)
    return rkey(*base), rkey(*base, "used"), rkey(*base, "err")


def lora_want_key(replica_id: int, adapter_id: int) -> str:
    return rkey("lora", replica_id, "want", adapter_id)


def lora_lock_key(replica_id: int) -> str:
    return rkey("lora", replica_id, "lock")


def engine_metrics_key(replica_id: int) -> str:
    """An engine replica's scraped telemetry (JSON)."""
    return rkey("engine", replica_id, "metrics")


def engine_own_key(replica_id: int) -> str:
    """Hash: tokens of Tollgate's own requests to an engine replica (``prompt``, ``cached``,
    ``generation``; ``inexact``: those whose tokens could not be told apart from others'),
    since the replica's first start. deployments/abort_check.py adds, the bill's check
    against the engine (metering/engine_ledger.py) subtracts them."""
    return rkey("engine", replica_id, "own")


def engine_ledger_key(replica_id: int) -> str:
    """The bill's check against an engine replica: its last observations and checkpoints
    (JSON, metering/engine_ledger.py)."""
    return rkey("engine", replica_id, "ledger")


def engine_ledger_lock_key() -> str:
    """Held by the one pass of the bill's check that runs at a time."""
    return rkey("ledger", "lock")


def engine_ledger_stats_key() -> str:
    """Hash: replica id -> the check's figures for the gateway's /metrics (JSON)."""
    return rkey("ledger", "stats")


def preempt_channel() -> str:
    """Channel: the gateway took this request's engine slot for a higher class (the payload,
    its id): the process serving it aborts it upstream and resumes it later."""
    return _preempt_channel(setting(PREFIX_SETTING))


@lru_cache(maxsize=16)
def _preempt_channel(prefix: str) -> str:  # every admission passes it: cached per prefix
    return f"{prefix}:adm:preempt"


def invalidation_channel() -> str:
    """Channel: cached state changed (``core.changes.publish_change``)."""
    return rkey("gateway", "invalidate")


def demand_used_key() -> str:
    """Sorted set: on-demand deployment id -> when a request last used it (epoch seconds)."""
    return rkey("demand", "used")


def demand_wake_key(deployment_id: int) -> str:
    """Set (NX, with the start timeout as TTL) while a start of the on-demand deployment is
    asked for or under way: however many requests wait, one start."""
    return rkey("demand", deployment_id, "wake")


def demand_failed_key(deployment_id: int) -> str:
    """Why the last start of the on-demand deployment failed or was refused (short TTL):
    the requests waiting for it answer with it instead of waiting out their timeout."""
    return rkey("demand", deployment_id, "failed")


def demand_stats_key() -> str:
    """Hash: on-demand starts, evictions and seconds to ready per model (the worker counts,
    the gateway's /metrics shows them)."""
    return rkey("demand", "stats")


def demand_node_lock(node_id: int) -> str:
    """One on-demand start decision at a time per node (what fits, what to evict)."""
    return rkey("demand", "node", node_id, "lock")
