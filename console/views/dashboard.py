"""The platform admin's dashboard: fleet, deployments, live traffic, top tenants, problems."""

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from console import queries
from console.access import staff_required
from metering import bill_check


@staff_required
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "console/dashboard/page.html",
        {
            "nav": "dashboard",
            "live": queries.live_rates(),
            "nodes": queries.nodes_with_memory(),
            "by_state": queries.deployments_by_state(),
            "top": queries.top_tenants_today(),
            "problems": queries.recent_problems(),
            "bill_checks": bill_check.replica_checks(),
        },
    )


@staff_required
def dashboard_live(request: HttpRequest) -> HttpResponse:
    """htmx, every 5 s: requests/s and tokens/s over the last minute."""
    return render(request, "console/dashboard/_live.html", {"live": queries.live_rates()})
