"""The usage record: what the gateway writes to the usage stream for each request.

One record per request (finished, failed or cut off), keyed by a unique request id. The
gateway appends it with ``XADD <core.keyspace.usage_stream()> * e <json>``; metering's
consumer reads it with a consumer group and stores it in PostgreSQL idempotently on
``request_id``.
"""

from dataclasses import dataclass

import orjson

FIELD = b"e"  # the stream entry's one field


@dataclass(slots=True)  # not frozen: see gateway/limiter.py (the gateway makes one a request)
class UsageRecord:
    """One request's usage as the gateway saw it. Times are Unix seconds (UTC)."""

    request_id: str
    occurred_at: float
    tenant_id: int
    api_key_id: int | None
    model_id: int
    deployment_id: int | None
    endpoint: str  # metering.choices.Endpoint value
    priority: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    status: str  # metering.choices.UsageStatus value
    http_status: int
    latency_ms: int
    ttft_ms: int | None
    price_id: int | None  # the price version the gateway saw in force; None: look it up
    # The prompt's tokens are an estimate: neither the engine nor its tokenizer counted them.
    prompt_estimated: bool = False
    # The LoRA adapter the tenant called (deployments.Adapter id); model_id is then its base.
    # None: the base model itself (and every record written before adapters existed).
    adapter_id: int | None = None
    # Milliseconds the request waited for its on-demand model to start (None: it did not).
    start_wait_ms: int | None = None
    # The engine replica that served it (deployments.Replica id; None: none did), for the
    # check of the bill against that engine's own counters (metering/engine_ledger.py).
    replica_id: int | None = None
    # Times the gateway preempted it: the engine redid work that was never billed.
    preemptions: int = 0

    def encode(self) -> bytes:
        return orjson.dumps(self)  # orjson serialises dataclasses natively (no asdict copy)

    @classmethod
    def decode(cls, raw: bytes | str) -> "UsageRecord":
        return cls(**orjson.loads(raw))
