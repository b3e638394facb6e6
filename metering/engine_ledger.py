"""The bill checked against the engines: per replica, the tokens Tollgate billed for the
requests an engine served, against that engine's own counters.

vLLM counts every token it processes (``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:prompt_tokens_cached_total``). The worker scrapes
them every few seconds (deployments/fleet.py), and records with each scrape the usage
stream's last id read just *before* it, the gateway's slot holders for the model read just
*after* it, and the tokens of Tollgate's own requests to that engine.

A **checkpoint** is a moment at which the counters and the bill can be compared exactly:
two scrapes found the engine running and queueing nothing, the gateway holding no engine
slot on the model, and the same counters. Then every request the counters include was
settled (its usage event appended) before the later scrape's stream id: it was counted
before the earlier scrape and no gateway held it after that scrape. And every event up to
that id was counted by the engine before the scrape (an engine counts a request's tokens
before the gateway sees its answer end). So between two checkpoints, the engine's counter
deltas equal the tokens billed for that replica's events between the two stream ids, plus
Tollgate's own requests' tokens, within two allowances for requests Tollgate closed early
(the client left, a timeout): the engine may make up to
``TOLLGATE_ENGINE_ABORT_ALLOWANCE_TOKENS`` tokens for one after the close, before its abort
lands (made, never delivered, so never billed); and closed before its first token, the
engine may not have counted its prompt at all. Anything beyond is **drift**.

A stretch is compared once ingestion has stored every event up to its end (the metering
group acknowledged them), so an event lost on the way (dropped, dead-lettered) shows.
Stretches that cannot be compared exactly are kept apart, with their billed tokens:
an engine restart (a new container, or counters that went down) ends a stretch, and
comparing resumes from the new engine's first checkpoint; a stretch holding a request the
gateway preempted (the engine redid work that is nobody's bill), one whose prompt only the
gateway estimated, or one where Tollgate's own check request overlapped other traffic is
*inexact*. Engines that export no token counters (some external ones) are shown as such,
never as zero drift. An engine's warm-up comes before its first checkpoint (a replica is
scraped once ready), and health checks make no tokens.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta

import orjson
import redis
from django.conf import settings
from django.db.models import Count, F, Q, Sum
from django.dispatch import Signal

from alerts.choices import Event, Severity
from alerts.services import raise_alert
from core.keyspace import (
    engine_ledger_key,
    engine_ledger_lock_key,
    engine_ledger_stats_key,
    usage_stream,
)
from core.redis import get_redis
from deployments import fleet
from deployments.choices import ReplicaState
from deployments.models import Replica
from metering.choices import UsageStatus
from metering.ingest import GROUP
from metering.models import EngineLedger, UsageEvent

log = logging.getLogger("tollgate.metering.ledger")

# Sent for each stretch whose drift passes the alert threshold (the alerts app listens):
# kwargs ``ledger`` (the EngineLedger row), ``stretch`` (a Stretch).
drift_found = Signal()

KINDS = ("prompt", "cached", "generation")
STATE_TTL_SECONDS = 7 * 86400
INGEST_WAIT_SECONDS = 2.0
PASS_LOCK_SECONDS = 120


@dataclass
class Mark:
    """A replica's counters at one scrape, with what the comparison needs beside them."""

    at: float
    incarnation: str
    prompt: int
    cached: int | None  # None: the engine does not export cached prompt tokens
    generation: int
    stream_id: str
    quiet: bool
    own: dict[str, int] = field(default_factory=dict)

    def counters(self) -> tuple[int, int | None, int]:
        return self.prompt, self.cached, self.generation


@dataclass
class State:
    """What the check keeps per replica between runs (Redis, engine_ledger_key)."""

    base: Mark | None = None  # the last checkpoint compared up to
    pending: Mark | None = None  # a later checkpoint waiting for ingestion
    last: Mark | None = None  # the last scrape seen
    counters: bool = True  # the engine exports token counters

    @classmethod
    def load(cls, replica_id: int) -> State:
        raw = get_redis().get(engine_ledger_key(replica_id))
        if not raw:
            return cls()
        data = orjson.loads(raw)
        marks = {k: Mark(**data[k]) if data.get(k) else None for k in ("base", "pending", "last")}
        return cls(**marks, counters=data.get("counters", True))

    def save(self, replica_id: int) -> None:
        get_redis().set(
            engine_ledger_key(replica_id), orjson.dumps(asdict(self)), ex=STATE_TTL_SECONDS
        )


@dataclass
class Stretch:
    """One compared stretch of a replica's life, between two checkpoints."""

    start: Mark
    end: Mark
    engine: dict[str, int]
    billed: dict[str, int]
    own: dict[str, int]
    requests: int = 0
    cuts: int = 0
    undelivered: int = 0
    drift: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    kind: str = "exact"  # exact | drift | restart | inexact
    why: str = ""

    @property
    def drifted(self) -> bool:
        return any(self.drift.values())


# --- Observing ------------------------------------------------------------------------------


def mark_of(figures: dict) -> Mark | None:
    """The scrape as a Mark; None when the engine exports no token counters."""
    if "prompt_tokens_total" not in figures or "generation_tokens_total" not in figures:
        return None
    cached = figures.get("prompt_tokens_cached_total")
    return Mark(
        at=float(figures["scraped_at"]),
        incarnation=str(figures.get("incarnation", "")),
        prompt=int(figures["prompt_tokens_total"]),
        cached=None if cached is None else int(cached),
        generation=int(figures["generation_tokens_total"]),
        stream_id=str(figures.get("stream_id", "0-0")),
        quiet=figures.get("running", 1) == 0
        and figures.get("waiting", 1) == 0
        and figures.get("slot_holders", 1) == 0,
        own={k: int(v) for k, v in (figures.get("own") or {}).items()},
    )


def observe(replica: Replica, figures: dict) -> Stretch | None:
    """Take one scrape of ``replica`` into its check; compare a stretch when one is due."""
    state = State.load(replica.pk)
    mark = mark_of(figures)
    if mark is None:
        if state.counters:
            log.warning("replica %s exports no token counters: its bill cannot be checked", replica)
        state.counters = False
        state.save(replica.pk)
        return None
    state.counters = True
    last = state.last
    if last is None or mark.at > last.at:  # else: the same scrape as last time
        state.last = mark
        if _checkpoint(last, mark):
            if state.base is None:
                state.base = mark
            else:
                state.pending = mark
    stretch = None
    if state.base and state.pending and _ingested(state.pending.stream_id):
        stretch = compare(replica, state.base, state.pending)
        if stretch.requests or stretch.kind != "exact" or any(stretch.engine.values()):
            record(replica, stretch)
        else:
            stretch = None  # an idle stretch: nothing to keep
        state.base, state.pending = state.pending, None
    state.save(replica.pk)
    return stretch


def _checkpoint(last: Mark | None, mark: Mark) -> bool:
    return (
        last is not None
        and last.quiet
        and mark.quiet
        and last.incarnation == mark.incarnation
        and last.counters() == mark.counters()
    )


def _ingested(stream_id: str) -> bool:
    """Whether ingestion stored every event up to ``stream_id``, waiting a moment for it
    (the usage service stores within a second or so)."""
    deadline = time.monotonic() + INGEST_WAIT_SECONDS
    while not ingested_through(stream_id):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def ingested_through(stream_id: str) -> bool:
    """Whether metering's consumer group has stored (acknowledged) every usage event up to
    ``stream_id``."""
    client, stream, upto = get_redis(), usage_stream(), _sid(stream_id)
    if upto == (0, 0):
        return True
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return False
    group = next((g for g in groups if _text(g["name"]) == GROUP), None)
    if group is None or _sid(_text(group["last-delivered-id"])) < upto:
        return False
    pending = client.xpending(stream, GROUP)
    return not pending["pending"] or _sid(_text(pending["min"])) > upto


# --- Comparing ------------------------------------------------------------------------------


def compare(replica: Replica, start: Mark, end: Mark) -> Stretch:
    """The stretch from checkpoint ``start`` to checkpoint ``end``, compared."""
    events = UsageEvent.objects.filter(replica_id=replica.pk).filter(
        _after(start.stream_id), _upto(end.stream_id)
    )
    sums = events.aggregate(
        prompt=Sum("prompt_tokens"),
        cached=Sum("cached_tokens"),
        generation=Sum("completion_tokens"),
        requests=Count("id"),
        cuts=Count("id", filter=~Q(status=UsageStatus.OK)),
        unstarted=Sum("prompt_tokens", filter=~Q(status=UsageStatus.OK) & Q(completion_tokens=0)),
        preempted=Count("id", filter=Q(preemptions__gt=0)),
        estimated=Count("id", filter=Q(prompt_estimated=True)),
    )
    billed = {k: int(sums[k] or 0) for k in KINDS}
    own = {k: end.own.get(k, 0) - start.own.get(k, 0) for k in KINDS}
    stretch = Stretch(
        start=start,
        end=end,
        engine=_deltas(start, end),
        billed=billed,
        own=own,
        requests=sums["requests"],
        cuts=sums["cuts"],
    )
    if start.incarnation != end.incarnation or any(
        v is not None and v < 0 for v in stretch.engine.values()
    ):
        stretch.kind, stretch.why = "restart", "the engine restarted: its counters began again"
    elif (
        sums["preempted"]
        or sums["estimated"]
        or end.own.get("inexact", 0) > start.own.get("inexact", 0)
    ):
        stretch.kind, stretch.why = "inexact", _inexact_reason(sums, start, end)
    else:
        _judge(stretch, int(sums["unstarted"] or 0))
    return stretch


def _judge(stretch: Stretch, unstarted_prompt: int) -> None:
    """Drift: how far each engine count lies outside what the bill allows it to be."""
    allowance = settings.TOLLGATE_ENGINE_ABORT_ALLOWANCE_TOKENS * stretch.cuts
    for kind in KINDS:
        engine = stretch.engine[kind]
        if engine is None:
            continue  # the engine does not count it
        expected = stretch.billed[kind] + stretch.own[kind]
        low, high = expected, expected
        if kind == "generation":
            high += allowance
        elif kind == "prompt":
            low -= unstarted_prompt
        else:  # cached: a prompt cut before its first token may or may not have hit the cache
            low, high = low - unstarted_prompt, high + unstarted_prompt
        stretch.drift[kind] = engine - min(max(engine, low), high)
        if kind == "generation" and not stretch.drift[kind]:
            stretch.undelivered = engine - expected
    if stretch.drifted:
        stretch.kind = "drift"


def _inexact_reason(sums: dict, start: Mark, end: Mark) -> str:
    reasons = []
    if sums["preempted"]:
        reasons.append(f"{sums['preempted']} preempted request(s): the engine redid unbilled work")
    if sums["estimated"]:
        reasons.append(f"{sums['estimated']} request(s) whose prompt only the gateway estimated")
    if end.own.get("inexact", 0) > start.own.get("inexact", 0):
        reasons.append("Tollgate's own check request overlapped other traffic")
    return "; ".join(reasons)


def _deltas(start: Mark, end: Mark) -> dict[str, int | None]:
    cached = None if start.cached is None or end.cached is None else end.cached - start.cached
    return {
        "prompt": end.prompt - start.prompt,
        "cached": cached,
        "generation": end.generation - start.generation,
    }


# --- Recording ------------------------------------------------------------------------------


def record(replica: Replica, stretch: Stretch) -> EngineLedger:
    """Add the stretch to its replica's hour (atomic increments), and alert on drift."""
    hour = datetime.fromtimestamp(stretch.end.at, UTC).replace(minute=0, second=0, microsecond=0)
    deployment = replica.deployment
    row, _ = EngineLedger.objects.get_or_create(
        replica_id=replica.pk,
        hour=hour,
        defaults={
            "deployment": deployment,
            "deployment_name": deployment.name,
            "replica_index": replica.index,
        },
    )
    changes: dict = {"checks": F("checks") + 1, "requests": F("requests") + stretch.requests}
    if stretch.kind in ("exact", "drift"):
        for kind in KINDS:
            engine = stretch.engine[kind] or 0
            changes[f"engine_{kind}"] = F(f"engine_{kind}") + engine
            changes[f"billed_{kind}"] = F(f"billed_{kind}") + stretch.billed[kind]
            changes[f"own_{kind}"] = F(f"own_{kind}") + stretch.own[kind]
            changes[f"drift_{kind}"] = F(f"drift_{kind}") + stretch.drift[kind]
        changes["cut_requests"] = F("cut_requests") + stretch.cuts
        changes["undelivered_generation"] = F("undelivered_generation") + stretch.undelivered
        if stretch.drifted:
            changes["drift_checks"] = F("drift_checks") + 1
    else:
        counter = "restarts" if stretch.kind == "restart" else "inexact_checks"
        changes[counter] = F(counter) + 1
        changes["unverified_prompt"] = F("unverified_prompt") + stretch.billed["prompt"]
        changes["unverified_generation"] = F("unverified_generation") + stretch.billed["generation"]
    changes["last_checked_at"] = datetime.fromtimestamp(stretch.end.at, UTC)
    EngineLedger.objects.filter(pk=row.pk).update(**changes)
    row.refresh_from_db()
    if stretch.kind == "drift":
        _alert(replica, row, stretch)
    return row


def _alert(replica: Replica, row: EngineLedger, stretch: Stretch) -> None:
    drift = sum(abs(v) for v in stretch.drift.values())
    counted = sum(abs(v or 0) for v in stretch.engine.values())
    if drift <= settings.TOLLGATE_ENGINE_DRIFT_ALERT_TOKENS:
        return
    if counted and drift * 100 <= settings.TOLLGATE_ENGINE_DRIFT_ALERT_PERCENT * counted:
        return
    log.warning(
        "bill drift on %s replica %s: engine counted %s, billed %s, Tollgate's own %s, "
        "drift %s over %d request(s)",
        row.deployment_name,
        replica.index,
        stretch.engine,
        stretch.billed,
        stretch.own,
        stretch.drift,
        stretch.requests,
    )
    drift_found.send(sender=EngineLedger, ledger=row, stretch=stretch)
    name = f"{row.deployment_name} replica {replica.index}"
    raise_alert(
        Event.ENGINE_DRIFT,
        title=f"Billed tokens differ from {name}'s own counters",
        detail=(
            f"Between {_when(stretch.start.at)} and {_when(stretch.end.at)} the engine "
            f"counted {_figures(stretch.engine)} tokens; Tollgate billed "
            f"{_figures(stretch.billed)} for {stretch.requests} request(s) and made "
            f"{_figures(stretch.own)} itself. Drift beyond the allowances: "
            f"{_figures(stretch.drift)}. Usage events may have been lost (check the usage "
            f"service and its dead letters) or requests reached the engine past Tollgate."
        ),
        payload=drift_payload(replica, row, stretch),
        severity=Severity.CRITICAL,
        # Once per replica and hour: the log line and the page show every stretch.
        dedupe_key=f"engine.drift:{replica.pk}:{row.hour:%Y-%m-%dT%H}",
    )


def drift_payload(replica: Replica, row: EngineLedger, stretch: Stretch) -> dict:
    """The ``engine.drift`` webhook's payload (docs/admins/alerts.md)."""
    return {
        "deployment": {"id": replica.deployment_id, "name": row.deployment_name},
        "replica": {"id": replica.pk, "index": replica.index},
        "hour": row.hour.isoformat(),
        "stretch": {"from": _when(stretch.start.at), "to": _when(stretch.end.at)},
        "requests": stretch.requests,
        "engine_tokens": stretch.engine,
        "billed_tokens": stretch.billed,
        "own_tokens": stretch.own,
        "drift_tokens": stretch.drift,
        "hour_drift_tokens": {k: getattr(row, f"drift_{k}") for k in KINDS},
    }


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


def _figures(values: dict[str, int | None]) -> str:
    return ", ".join(f"{k} {'n/a' if v is None else v}" for k, v in values.items())


# --- Running --------------------------------------------------------------------------------


def check_all() -> int:
    """One pass over every ready replica: scrape it (again at once when it just turned
    quiet, so a checkpoint needs no second pass) and compare what is due; the stretches
    compared. One pass at a time: a second one (beat's next, while this one still runs)
    returns at once rather than compare a stretch twice."""
    client, token = get_redis(), secrets.token_hex(8)
    if not client.set(engine_ledger_lock_key(), token, nx=True, ex=PASS_LOCK_SECONDS):
        return 0
    try:
        return _check_all()
    finally:
        if client.get(engine_ledger_lock_key()) == token.encode():
            client.delete(engine_ledger_lock_key())


def _check_all() -> int:
    compared = 0
    replicas = list(
        Replica.objects.filter(state=ReplicaState.READY)
        .filter(Q(deployment__external=True) | Q(port__isnull=False))
        .select_related("deployment")
    )
    for replica in replicas:
        for _ in range(2):
            figures = fleet.scrape_replica(replica)
            if figures is None:
                break
            if observe(replica, figures) is not None:
                compared += 1
            if not _turned_quiet(State.load(replica.pk)):
                break
    publish_stats(replicas)
    return compared


def _turned_quiet(state: State) -> bool:
    """The last scrape found the engine quiet but is no checkpoint yet: one more scrape
    with the same counters makes it one."""
    last = state.last
    if last is None or not last.quiet:
        return False
    return not any(mark is not None and mark.at == last.at for mark in (state.base, state.pending))


def publish_stats(replicas: object) -> None:
    """The figures the gateway's /metrics shows (core.keyspace.engine_ledger_stats_key):
    per ready replica, the last 24 hours' engine, billed and drift tokens."""
    # The current hour and the 23 before it.
    since = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=23)
    rows = (
        EngineLedger.objects.filter(replica_id__in=[r.pk for r in replicas])
        .filter(hour__gte=since)
        .values("replica_id")
        .annotate(
            **{f"engine_{k}": Sum(f"engine_{k}") for k in KINDS},
            **{f"billed_{k}": Sum(f"billed_{k}") for k in KINDS},
            **{f"drift_{k}": Sum(f"drift_{k}") for k in KINDS},
            restarts=Sum("restarts"),
            inexact=Sum("inexact_checks"),
        )
    )
    figures = {row["replica_id"]: row for row in rows}
    stats = {}
    for replica in replicas:
        state = State.load(replica.pk)
        entry = {
            "deployment": replica.deployment.name,
            "replica": replica.index,
            "counters": state.counters,
            "checked_at": state.base.at if state.base else None,
            **{k: int(v or 0) for k, v in figures.get(replica.pk, {}).items() if k != "replica_id"},
        }
        stats[str(replica.pk)] = orjson.dumps(entry)
    client = get_redis()
    with client.pipeline() as pipe:
        pipe.delete(engine_ledger_stats_key())
        if stats:
            pipe.hset(engine_ledger_stats_key(), mapping=stats)
        pipe.execute()


def replica_status(replica: Replica) -> dict:
    """What the console and the API show for one replica: its check's state now."""
    state = State.load(replica.pk)
    return {
        "counters": state.counters,
        "checked_at": datetime.fromtimestamp(state.base.at, UTC) if state.base else None,
        "waiting": state.pending is not None,
    }


# --- Stream ids -----------------------------------------------------------------------------


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sid(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def _after(stream_id: str) -> Q:
    ms, seq = _sid(stream_id)
    return Q(stream_ms__gt=ms) | Q(stream_ms=ms, stream_seq__gt=seq)


def _upto(stream_id: str) -> Q:
    ms, seq = _sid(stream_id)
    return Q(stream_ms__lt=ms) | Q(stream_ms=ms, stream_seq__lte=seq)
