"""``tollgate webhooks``, ``tollgate notices`` and ``tollgate forecast``: alert endpoints,
their delivery log, console notices and burn-rate forecasts, through the admin API.

    tollgate webhooks create https://hooks.acme.example/tollgate --tenant acme
    tollgate webhooks deliveries --status gave_up
    tollgate forecast --tenant acme
"""

import argparse
import sys
from typing import Any

from tollgate_cli.main import (
    _action,
    _delete,
    _fields,
    _group,
    _update,
    api,
    emit,
    print_table,
    show,
)

HOOKS = "/api/v1/webhooks/"
DELIVERIES = "/api/v1/webhook-deliveries/"
NOTICES = "/api/v1/notices/"
COLUMNS = {
    "webhooks": ["id", "tenant", "url", "events", "enabled", "secret_hint"],
    "deliveries": [
        "id",
        "event",
        "endpoint",
        "status",
        "response_code",
        "attempts",
        "next_attempt_at",
    ],
    "notices": ["id", "created_at", "tenant", "severity", "title", "acknowledged_at"],
}


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    _webhooks(commands, common)
    _notices(commands, common)
    forecast = commands.add_parser(
        "forecast",
        parents=[common],
        help="when quotas and key budgets run out at the last 24 h's rate",
    )
    whose = forecast.add_mutually_exclusive_group(required=True)
    whose.add_argument("--tenant", help="a tenant's quotas (slug)")
    whose.add_argument("--key", help="an API key's budgets (id)")
    forecast.set_defaults(run=cmd_forecast)


def _webhooks(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(
        commands, "webhooks", "signed webhook endpoints for alerts, and their deliveries"
    )
    listing = _action(group, common, "list", "list endpoints", cmd_webhooks_list)
    listing.add_argument("--tenant", help="only this tenant's (slug)")
    _action(group, common, "show", "one endpoint", lambda a: show(a, f"{HOOKS}{a.id}/"), "id")
    create = _action(group, common, "create", "add an endpoint (secret printed once)", cmd_create)
    create.add_argument("endpoint_url", metavar="URL", help="http(s) URL events are POSTed to")
    create.add_argument("--tenant", help="tenant slug (default: a platform endpoint, admins only)")
    create.add_argument(
        "--event",
        dest="events",
        action="append",
        metavar="EVENT",
        help="budget.threshold (default) or engine.drift (platform); repeatable",
    )
    create.add_argument("--description")
    create.add_argument("--disabled", action="store_true", help="make it switched off")
    update = _action(group, common, "update", "change fields", _update(HOOKS, "id"), "id")
    _fields(update)
    _action(group, common, "delete", "remove an endpoint and its log", _delete(HOOKS, "id"), "id")
    _action(group, common, "rotate-secret", "a new signing secret", cmd_rotate, "id")
    _action(group, common, "test", "send it a test event", cmd_test, "id")
    log = _action(group, common, "deliveries", "the delivery log", cmd_deliveries)
    log.add_argument("--endpoint", help="only this endpoint's (id)")
    log.add_argument("--tenant", help="only this tenant's (slug)")
    log.add_argument("--status", choices=["pending", "succeeded", "failed", "gave_up"])
    log.add_argument("--event", choices=["budget.threshold", "engine.drift", "test"])
    _action(group, common, "retry", "attempt a delivery again now", cmd_retry, "delivery")


def _notices(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(commands, "notices", "alerts shown in the console")
    listing = _action(group, common, "list", "list notices", cmd_notices_list)
    listing.add_argument("--open", action="store_true", help="only those not acknowledged")
    listing.add_argument("--tenant", help="only this tenant's (slug)")
    _action(group, common, "ack", "acknowledge a notice", cmd_ack, "id")


def _table(args: argparse.Namespace, kind: str, path: str, params: dict[str, Any]) -> None:
    rows = list(api(args).list(path, {k: v for k, v in params.items() if v is not None}))
    if args.json:
        emit(args, rows)
    else:
        print_table(rows, COLUMNS[kind])


def cmd_webhooks_list(args: argparse.Namespace) -> None:
    _table(args, "webhooks", HOOKS, {"tenant__slug": args.tenant})


def _print_secret(args: argparse.Namespace, answer: dict[str, Any], verb: str) -> None:
    if args.json:
        emit(args, answer)
        return
    print(answer["secret"])
    print(
        f"Endpoint {answer['id']} ({answer['url']}): signing secret {verb}, shown only now.",
        file=sys.stderr,
    )


def cmd_create(args: argparse.Namespace) -> None:
    body: dict[str, Any] = {
        "url": args.endpoint_url,
        "tenant": args.tenant,
        "events": args.events or ["budget.threshold"],
        "enabled": not args.disabled,
    }
    if args.description:
        body["description"] = args.description
    _print_secret(args, api(args).request("POST", HOOKS, json=body), "made")


def cmd_rotate(args: argparse.Namespace) -> None:
    answer = api(args).request("POST", f"{HOOKS}{args.id}/rotate-secret/")
    _print_secret(args, answer, "rotated (the old one signs no more)")


def cmd_test(args: argparse.Namespace) -> None:
    answer = api(args).request("POST", f"{HOOKS}{args.id}/test/")
    if args.json:
        emit(args, answer)
    else:
        print(f"Test event queued: delivery {answer['id']}.")


def cmd_deliveries(args: argparse.Namespace) -> None:
    params = {
        "endpoint": args.endpoint,
        "endpoint__tenant__slug": args.tenant,
        "status": args.status,
        "event": args.event,
    }
    _table(args, "deliveries", DELIVERIES, params)


def cmd_retry(args: argparse.Namespace) -> None:
    emit(args, api(args).request("POST", f"{DELIVERIES}{args.delivery}/retry/"))


def cmd_notices_list(args: argparse.Namespace) -> None:
    params = {"tenant__slug": args.tenant, "acknowledged_at__isnull": "true" if args.open else None}
    _table(args, "notices", NOTICES, params)


def cmd_ack(args: argparse.Namespace) -> None:
    answer = api(args).request("POST", f"{NOTICES}{args.id}/acknowledge/")
    if args.json:
        emit(args, answer)
    else:
        print(f"Acknowledged: {answer['title']}")


def cmd_forecast(args: argparse.Namespace) -> None:
    path = (
        f"/api/v1/tenants/{args.tenant}/forecast/"
        if args.tenant
        else f"/api/v1/keys/{args.key}/forecast/"
    )
    answer = api(args).request("GET", path)
    if args.json:
        emit(args, answer)
        return
    if not answer["forecasts"]:
        print("No quota (or budget) to forecast.")
    for forecast in answer["forecasts"]:
        print(f"{forecast['quota']}: {forecast['summary']}")
