"""What the console, the admin API and the dashboard show of the bill's check against the
engines (metering/engine_ledger.py does the checking): per replica, the last hours' tokens
the engine counted, Tollgate billed, the drift between them, and the check's state now."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Q, Sum
from django.utils import timezone

from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from metering.engine_ledger import KINDS, replica_status
from metering.models import EngineLedger

SUMMED = (
    *(f"{source}_{kind}" for source in ("engine", "billed", "own", "drift") for kind in KINDS),
    "checks",
    "requests",
    "cut_requests",
    "undelivered_generation",
    "drift_checks",
    "restarts",
    "inexact_checks",
    "unverified_prompt",
    "unverified_generation",
)


@dataclass
class ReplicaCheck:
    """One replica's check over a window of hours, and its state now."""

    replica_id: int
    deployment_name: str
    replica_index: int
    ready: bool
    counters: bool  # the engine exports token counters (an external one may not)
    checked_at: datetime | None  # the last checkpoint compared up to
    totals: dict[str, int] = field(default_factory=dict)

    @property
    def drift(self) -> int:
        return sum(abs(self.totals.get(f"drift_{kind}", 0)) for kind in KINDS)

    @property
    def status(self) -> str:
        """drift | no_counters | holds | unchecked: what a reader needs first."""
        if self.drift:
            return "drift"
        if not self.counters:
            return "no_counters"
        if self.totals.get("checks"):
            return "holds"
        return "unchecked"

    @property
    def status_text(self) -> str:
        return {
            "drift": "Drift: the bill and the engine disagree",
            "no_counters": "The engine exports no token counters: not checked",
            "holds": "The bill equals the engine's counters",
            "unchecked": "No stretch compared yet",
        }[self.status]

    def as_dict(self) -> dict:
        return {
            "replica_id": self.replica_id,
            "deployment": self.deployment_name,
            "replica": self.replica_index,
            "ready": self.ready,
            "status": self.status,
            "engine_exports_counters": self.counters,
            "last_compared_at": self.checked_at,
            "tokens": {
                source: {kind: self.totals.get(f"{source}_{kind}", 0) for kind in KINDS}
                for source in ("engine", "billed", "own", "drift")
            },
            **{
                name: self.totals.get(name, 0)
                for name in SUMMED
                if not name.startswith(("engine_", "billed_", "own_", "drift_"))
            },
        }


def window_start(hours: int) -> datetime:
    """The first hour of a window of ``hours`` hours ending with the current one."""
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    return now - timedelta(hours=hours - 1)


def replica_checks(
    deployments: Iterable[Deployment] | None = None, hours: int = 24
) -> list[ReplicaCheck]:
    """Every replica that served in the window or is ready now (of ``deployments``, or all)."""
    since = window_start(hours)
    rows = EngineLedger.objects.filter(hour__gte=since)
    replicas = Replica.objects.select_related("deployment")
    if deployments is not None:
        ids = [d.pk for d in deployments]
        rows = rows.filter(deployment_id__in=ids)
        replicas = replicas.filter(deployment_id__in=ids)
    sums = {
        row["replica_id"]: row
        for row in rows.values("replica_id", "deployment_name", "replica_index").annotate(
            **{name: Sum(name) for name in SUMMED}
        )
    }
    live = {r.pk: r for r in replicas.filter(Q(state=ReplicaState.READY) | Q(pk__in=list(sums)))}
    checks = []
    for replica_id in sorted(set(sums) | set(live)):
        replica, row = live.get(replica_id), sums.get(replica_id, {})
        state = replica_status(replica) if replica else {"counters": True, "checked_at": None}
        checks.append(
            ReplicaCheck(
                replica_id=replica_id,
                deployment_name=replica.deployment.name if replica else row["deployment_name"],
                replica_index=replica.index if replica else row["replica_index"],
                ready=bool(replica and replica.state == ReplicaState.READY),
                counters=state["counters"],
                checked_at=state["checked_at"],
                totals={name: int(row.get(name) or 0) for name in SUMMED},
            )
        )
    return sorted(checks, key=lambda c: (c.deployment_name, c.replica_index))


def hours_of(deployment: Deployment, hours: int = 24) -> list[EngineLedger]:
    """The deployment's hourly rows in the window, newest first."""
    return list(
        EngineLedger.objects.filter(deployment=deployment, hour__gte=window_start(hours)).order_by(
            "-hour", "replica_index"
        )
    )
