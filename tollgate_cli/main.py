"""``tollgate``: the admin API from a shell, for scripted set-up and CI.

    tollgate login --url http://appliance:8000 --username admin      (asks for the password)
    tollgate tenants create "Acme Research" --set requests_per_minute=120
    tollgate keys create --tenant acme-research --name notebook       (prints the key once)
    tollgate prices set --model qwen3-8b --input 0.20 --output 0.60
    tollgate adapters create acme/support-v3 --base qwen3-8b --source acme/support-v3-lora
    tollgate adapters upload acme/support-v3 support-v3.tar.gz        (new files, checked again)
    tollgate deployments create qwen --model qwen3-8b --mode on_demand --idle-timeout 600
    tollgate usage export --period 2026-11 --tenant acme-research -o acme.csv

Every command speaks the admin REST API (``/api/v1/``); ``--json`` prints its answers as
they come. Exit status: 0 done, 1 refused (the reason on stderr), 2 unreachable or misused.
"""

import argparse
import getpass
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from tollgate_cli.client import DEFAULT_URL, Api, CliError, config_path, save_config

# The columns a list shows, per resource (``--json`` shows everything).
COLUMNS = {
    "tenants": ["slug", "name", "status", "priority", "requests_per_minute", "quota_amount"],
    "keys": ["id", "tenant", "name", "key_hint", "status", "expires_at"],
    "models": ["served_name", "task", "visibility", "params_billions", "context_length"],
    "adapters": ["served_name", "base", "tenant", "visibility", "status", "rank"],
    "prices": ["id", "model", "currency", "input_per_mtok", "output_per_mtok", "effective_from"],
    "deployments": [
        "name",
        "model",
        "node",
        "replicas",
        "desired_state",
        "state",
        "mode",
        "demand_state",
    ],
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        args.run(args)
    except CliError as exc:
        print(f"tollgate: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130
    return 0


# --- Parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tollgate",
        description="Manage a Tollgate appliance through its admin API.",
        epilog="The login is read from TOLLGATE_URL/TOLLGATE_TOKEN, else from the file "
        f"`tollgate login` writes ({config_path()}).",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"the appliance (default: saved login, {DEFAULT_URL})")
    common.add_argument("--token", help="an admin API token (default: saved login)")
    common.add_argument("--json", action="store_true", help="print the API's JSON answers")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    login = commands.add_parser("login", parents=[common], help="get a token and save it")
    login.add_argument("--username", help="exchange this user's password for a token")
    login.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    login.add_argument("--name", default="command line", help="the token's label")
    login.add_argument("--days", type=int, help="token lifetime in days (1-365, default 30)")
    login.set_defaults(run=cmd_login)
    logout = commands.add_parser("logout", parents=[common], help="forget the saved login")
    logout.set_defaults(run=cmd_logout)

    _tenants(commands, common)
    _keys(commands, common)
    _models(commands, common)
    _adapters(commands, common)
    _prices(commands, common)
    _deployments(commands, common)
    _usage(commands, common)
    from tollgate_cli import alerts  # it builds on this module's helpers

    alerts.register(commands, common)
    return parser


def _group(commands: Any, name: str, help: str) -> Any:
    group = commands.add_parser(name, help=help)
    group.set_defaults(run=lambda args: group.print_help(sys.stderr) or _usage_error())
    return group.add_subparsers(title="actions", metavar="ACTION")


def _usage_error() -> None:
    raise CliError("name an action (see --help)", status=2)


def _fields(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="fields",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any field of the resource; VALUE is read as JSON when it parses (10, true, "
        '["a"]), else as text; repeatable',
    )


def _action(
    group: Any,
    common: argparse.ArgumentParser,
    name: str,
    help: str,
    run: Callable[[argparse.Namespace], None],
    *positionals: str,
) -> argparse.ArgumentParser:
    action = group.add_parser(name, parents=[common], help=help)
    for positional in positionals:
        action.add_argument(positional)
    action.set_defaults(run=run)
    return action


def _tenants(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(commands, "tenants", "tenants: limits, quotas, status")
    path = "/api/v1/tenants/"
    _action(group, common, "list", "list tenants", lambda a: show_list(a, "tenants", path))
    _action(group, common, "show", "one tenant", lambda a: show(a, f"{path}{a.slug}/"), "slug")
    create = _action(group, common, "create", "add a tenant", cmd_tenant_create, "name")
    create.add_argument("--slug", help="URL name (default: from the name)")
    _fields(create)
    update = _action(group, common, "update", "change fields", _update(path, "slug"), "slug")
    _fields(update)
    for verb in ("suspend", "activate"):
        _action(group, common, verb, f"{verb} a tenant", _post(path, "slug", verb), "slug")
    _action(group, common, "delete", "remove a tenant", _delete(path, "slug"), "slug")


def _keys(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(commands, "keys", "tenants' inference API keys")
    path = "/api/v1/keys/"
    listing = _action(group, common, "list", "list keys", cmd_keys_list)
    listing.add_argument("--tenant", help="only this tenant's (slug)")
    _action(group, common, "show", "one key", lambda a: show(a, f"{path}{a.id}/"), "id")
    create = _action(group, common, "create", "issue a key (printed once)", cmd_key_create)
    create.add_argument("--tenant", required=True, help="tenant slug")
    create.add_argument("--name", required=True, help="a label for the key")
    create.add_argument("--expires-at", help="ISO time, e.g. 2027-01-01T00:00:00Z")
    _fields(create)
    _action(group, common, "revoke", "revoke a key for good", _post(path, "id", "revoke"), "id")


def _models(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(commands, "models", "the model catalogue")
    path = "/api/v1/models/"
    _action(group, common, "list", "list models", lambda a: show_list(a, "models", path))
    _action(group, common, "show", "one model", lambda a: show(a, f"{path}{a.name}/"), "name")
    create = _action(group, common, "create", "add a model", cmd_model_create, "served_name")
    create.add_argument("--source", required=True, help="Hugging Face repo id (org/name)")
    create.add_argument("--params-billions", required=True, help="parameters, billions")
    create.add_argument("--context-length", required=True, type=int, help="tokens")
    _fields(create)
    update = _action(group, common, "update", "change fields", _update(path, "name"), "name")
    _fields(update)
    _action(group, common, "delete", "remove a model", _delete(path, "name"), "name")
    for verb in ("grant", "ungrant"):
        _action(
            group, common, verb, f"{verb} a private model", _grant(path, verb), "name", "tenant"
        )


def _adapters(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(commands, "adapters", "LoRA adapters on a base model")
    path = "/api/v1/adapters/"
    listing = _action(group, common, "list", "list adapters", cmd_adapters_list)
    listing.add_argument("--base", help="only this base model's (served name)")
    listing.add_argument("--tenant", help="only this tenant's (slug)")
    listing.add_argument("--status", choices=["checking", "ready", "failed"])
    _action(group, common, "show", "one adapter", lambda a: show(a, f"{path}{a.name}/"), "name")
    create = _action(group, common, "create", "register an adapter", cmd_adapter_create)
    create.add_argument("served_name", help="the name clients pass as model")
    create.add_argument("--base", required=True, help="the base model's served name")
    files = create.add_mutually_exclusive_group(required=True)
    files.add_argument(
        "--source", help="hub id (downloaded into nodes' caches if missing), or a cache folder"
    )
    files.add_argument(
        "--archive", metavar="FILE", help="upload its files: a .tar, .tar.gz or .zip"
    )
    create.add_argument("--tenant", help="owner tenant slug (default: yours; admins: none)")
    create.add_argument("--description")
    create.add_argument("--pinned", action="store_true", help="keep it loaded on every replica")
    _fields(create)
    update = _action(group, common, "update", "change fields", _update(path, "name"), "name")
    _fields(update)
    _action(group, common, "delete", "remove an adapter", _delete(path, "name"), "name")
    grant = _grant(path, "grant")
    _action(group, common, "grant", "let a tenant call it", grant, "name", "tenant")
    revoke = group.add_parser(
        "revoke", parents=[common], aliases=["ungrant"], help="take a tenant's grant away"
    )
    revoke.add_argument("name")
    revoke.add_argument("tenant")
    revoke.set_defaults(run=_grant(path, "ungrant"))
    check = _post(path, "name", "check")
    _action(group, common, "check", "check its files again", check, "name")
    upload = _action(group, common, "upload", "replace its files", cmd_adapter_upload, "name")
    upload.add_argument("archive", metavar="FILE", help="a .tar, .tar.gz or .zip of its files")


def _prices(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(commands, "prices", "versioned prices per model and adapter")
    listing = _action(group, common, "list", "list price versions", cmd_prices_list)
    listing.add_argument("--model", help="only this model's (served name)")
    listing.add_argument("--adapter", help="only this adapter's (served name)")
    price = _action(group, common, "set", "start a new price version", cmd_price_set)
    what = price.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="served name")
    what.add_argument("--adapter", help="an adapter's served name (its own price)")
    price.add_argument("--input", required=True, help="per 1M input tokens")
    price.add_argument("--output", required=True, help="per 1M output tokens")
    price.add_argument("--cached-input", help="per 1M cached input tokens (default: input)")
    price.add_argument("--currency", help="e.g. USD (default: USD)")
    price.add_argument("--effective-from", help="ISO time (default: now; never in the past)")


def _deployments(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(commands, "deployments", "what runs where")
    path = "/api/v1/deployments/"
    _action(group, common, "list", "list deployments", lambda a: show_list(a, "deployments", path))
    _action(group, common, "show", "one deployment", lambda a: show(a, f"{path}{a.name}/"), "name")
    create = _action(group, common, "create", "add a deployment", cmd_deployment_create, "name")
    create.add_argument("--model", required=True, help="served name")
    create.add_argument("--node", help="node name (default: Tollgate places it)")
    create.add_argument("--profile", help="engine profile, e.g. dgx-spark")
    create.add_argument("--image", help="engine image (default: the profile's)")
    create.add_argument("--replicas", type=int)
    create.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="a vllm serve flag, e.g. max-num-seqs=4; repeatable",
    )
    _demand_flags(create)
    _fields(create)
    update = _action(group, common, "update", "change fields", cmd_deployment_update, "name")
    _demand_flags(update)
    _fields(update)
    for verb in ("start", "stop", "restart", "remove"):
        _action(group, common, verb, f"{verb} a deployment", _post(path, "name", verb), "name")
    logs = _action(group, common, "logs", "a replica's engine log", cmd_logs, "name")
    logs.add_argument("--replica", type=int, default=0)
    logs.add_argument("--lines", type=int, default=200)


def _demand_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=["always", "on_demand"],
        help="always running, or on_demand: started by the first request, stopped when idle",
    )
    parser.add_argument(
        "--idle-timeout",
        type=int,
        metavar="SECONDS",
        help="on demand: unused this long, its replicas are stopped (10-86400, default 900)",
    )
    parser.add_argument(
        "--start-timeout",
        type=int,
        metavar="SECONDS",
        help="on demand: how long a request waits for a start before a 503 (10-86400, default 600)",
    )


def _usage(commands: Any, common: argparse.ArgumentParser) -> None:
    group = _group(commands, "usage", "usage and showback")
    export = _action(group, common, "export", "showback CSV", cmd_usage_export)
    export.add_argument("--period", help="a month (2026-11) or a day (2026-11-26)")
    export.add_argument("--start", help="date or ISO time (instead of --period)")
    export.add_argument("--end", help="date or ISO time, exclusive")
    export.add_argument("--tenant", help="tenant slug")
    export.add_argument("--model", help="served name")
    export.add_argument("--key", help="API key prefix")
    export.add_argument("--granularity", choices=["hour", "day", "month"])
    export.add_argument("--format", choices=["showback", "focus"])
    export.add_argument("-o", "--output", help="file to write (default: stdout)")


# --- Commands -----------------------------------------------------------------------------


def api(args: argparse.Namespace) -> Api:
    return Api.from_settings(args.url, args.token)


def cmd_login(args: argparse.Namespace) -> None:
    url = (args.url or Api.from_settings(None, None).url).rstrip("/")
    if args.username:
        if args.password_stdin:
            password = sys.stdin.readline().rstrip("\n")
        else:
            password = getpass.getpass(f"Password for {args.username} at {url}: ")
        body: dict[str, Any] = {
            "username": args.username,
            "password": password,
            "name": args.name,
        }
        if args.days:
            body["expires_in_days"] = args.days
        token = Api(url, None).request("POST", "/api/v1/auth/token/", json=body)["token"]
    elif args.token:
        token = args.token
        Api(url, token).request("GET", "/api/v1/tokens/", params={"limit": 1})  # does it work?
    else:
        raise CliError("give --username (a password is asked for) or --token", status=2)
    path = save_config(url, token)
    print(f"Logged in to {url}; the token is saved in {path} (readable by you only).")


def cmd_logout(args: argparse.Namespace) -> None:
    path = config_path()
    path.unlink(missing_ok=True)
    print(f"Removed {path}.")


def cmd_tenant_create(args: argparse.Namespace) -> None:
    body = {"name": args.name, **_parse_fields(args.fields)}
    if args.slug:
        body["slug"] = args.slug
    emit(args, api(args).request("POST", "/api/v1/tenants/", json=body))


def cmd_keys_list(args: argparse.Namespace) -> None:
    params = {"tenant__slug": args.tenant} if args.tenant else None
    show_list(args, "keys", "/api/v1/keys/", params)


def cmd_key_create(args: argparse.Namespace) -> None:
    body = {"tenant": args.tenant, "name": args.name, **_parse_fields(args.fields)}
    if args.expires_at:
        body["expires_at"] = args.expires_at
    created = api(args).request("POST", "/api/v1/keys/", json=body)
    if args.json:
        emit(args, created)
        return
    print(created["key"])
    print(
        f"Key {created['id']} ({created['prefix']}) for {created['tenant']}: shown only now.",
        file=sys.stderr,
    )


def cmd_model_create(args: argparse.Namespace) -> None:
    body = {
        "served_name": args.served_name,
        "source": args.source,
        "params_billions": args.params_billions,
        "context_length": args.context_length,
        **_parse_fields(args.fields),
    }
    emit(args, api(args).request("POST", "/api/v1/models/", json=body))


def cmd_adapters_list(args: argparse.Namespace) -> None:
    filters = {"base__served_name": args.base, "tenant__slug": args.tenant, "status": args.status}
    params = {k: v for k, v in filters.items() if v is not None}
    show_list(args, "adapters", "/api/v1/adapters/", params)


def cmd_adapter_create(args: argparse.Namespace) -> None:
    body: dict[str, Any] = {"served_name": args.served_name, "base": args.base}
    optional = {"tenant": args.tenant, "description": args.description, "source": args.source}
    body |= {k: v for k, v in optional.items() if v is not None}
    if args.pinned:
        body["pinned"] = True
    body |= _parse_fields(args.fields)
    if args.archive is None:
        emit(args, api(args).request("POST", "/api/v1/adapters/", json=body))
        return
    with _opened(args.archive) as archive:
        answer = api(args).request(
            "POST",
            "/api/v1/adapters/",
            data={name: _form_value(value) for name, value in body.items()},
            files={"archive": archive},
            timeout=UPLOAD_TIMEOUT,
        )
    emit(args, answer)


def cmd_adapter_upload(args: argparse.Namespace) -> None:
    with _opened(args.archive) as archive:
        answer = api(args).request(
            "POST",
            f"/api/v1/adapters/{args.name}/upload/",
            files={"archive": archive},
            timeout=UPLOAD_TIMEOUT,
        )
    emit(args, answer)


# An upload is streamed from the file; the appliance checks it before it answers.
UPLOAD_TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def _opened(path: str) -> Any:
    """The archive to upload, opened for streaming (never read whole)."""
    try:
        return open(path, "rb")  # noqa: SIM115 - closed by the caller's with
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror}", status=2) from None


def _form_value(value: Any) -> str:
    """A field of a multipart body, as the API reads it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        raise CliError("with --archive, give lists and objects later with update", status=2)
    return str(value)


def cmd_prices_list(args: argparse.Namespace) -> None:
    filters = {"model__served_name": args.model, "adapter__served_name": args.adapter}
    params = {k: v for k, v in filters.items() if v is not None}
    show_list(args, "prices", "/api/v1/prices/", params or None)


def cmd_price_set(args: argparse.Namespace) -> None:
    what = {"model": args.model} if args.model else {"adapter": args.adapter}
    body = {**what, "input_per_mtok": args.input, "output_per_mtok": args.output}
    optional = {
        "cached_input_per_mtok": args.cached_input,
        "currency": args.currency,
        "effective_from": args.effective_from,
    }
    body |= {k: v for k, v in optional.items() if v is not None}
    emit(args, api(args).request("POST", "/api/v1/prices/", json=body))


def cmd_deployment_create(args: argparse.Namespace) -> None:
    body: dict[str, Any] = {"name": args.name, "model": args.model}
    optional = {
        "node": args.node,
        "profile": args.profile,
        "image": args.image,
        "replicas": args.replicas,
    }
    body |= {k: v for k, v in optional.items() if v is not None}
    if args.engine_arg:
        body["engine_args"] = _parse_fields(args.engine_arg)
    body |= _demand_fields(args) | _parse_fields(args.fields)
    emit(args, api(args).request("POST", "/api/v1/deployments/", json=body))


def cmd_deployment_update(args: argparse.Namespace) -> None:
    body = _demand_fields(args) | _parse_fields(args.fields)
    if not body:
        flags = "--mode, --idle-timeout, --start-timeout or --set FIELD=VALUE"
        raise CliError(f"give {flags}", status=2)
    emit(args, api(args).request("PATCH", f"/api/v1/deployments/{args.name}/", json=body))


def _demand_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The on-demand settings given as flags, under the API's field names."""
    given = {
        "mode": args.mode,
        "idle_timeout_seconds": args.idle_timeout,
        "start_timeout_seconds": args.start_timeout,
    }
    return {name: value for name, value in given.items() if value is not None}


def cmd_logs(args: argparse.Namespace) -> None:
    params = {"replica": args.replica, "lines": args.lines}
    answer = api(args).request("GET", f"/api/v1/deployments/{args.name}/logs/", params=params)
    if args.json:
        emit(args, answer)
    else:
        print(answer["log"])


def cmd_usage_export(args: argparse.Namespace) -> None:
    names = ("period", "start", "end", "tenant", "model", "key", "granularity", "format")
    params = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.output:
        with open(args.output, "w", encoding="utf-8", newline="") as out:
            size = api(args).download("/api/v1/usage/export.csv", params, out)
        print(f"Wrote {size} bytes to {args.output}.", file=sys.stderr)
    else:
        api(args).download("/api/v1/usage/export.csv", params, sys.stdout)


def _update(path: str, key: str) -> Callable[[argparse.Namespace], None]:
    def run(args: argparse.Namespace) -> None:
        body = _parse_fields(args.fields)
        if not body:
            raise CliError("give at least one --set FIELD=VALUE", status=2)
        emit(args, api(args).request("PATCH", f"{path}{getattr(args, key)}/", json=body))

    return run


def _post(path: str, key: str, verb: str) -> Callable[[argparse.Namespace], None]:
    def run(args: argparse.Namespace) -> None:
        answer = api(args).request("POST", f"{path}{getattr(args, key)}/{verb}/")
        if answer is None:
            print(f"{getattr(args, key)}: done.")
        else:
            emit(args, answer)

    return run


def _delete(path: str, key: str) -> Callable[[argparse.Namespace], None]:
    def run(args: argparse.Namespace) -> None:
        api(args).request("DELETE", f"{path}{getattr(args, key)}/")
        print(f"Removed {getattr(args, key)}.")

    return run


def _grant(path: str, verb: str) -> Callable[[argparse.Namespace], None]:
    def run(args: argparse.Namespace) -> None:
        body = {"tenant": args.tenant}
        emit(args, api(args).request("POST", f"{path}{args.name}/{verb}/", json=body))

    return run


# --- Output -------------------------------------------------------------------------------


def show(args: argparse.Namespace, path: str) -> None:
    emit(args, api(args).request("GET", path))


def show_list(
    args: argparse.Namespace, resource: str, path: str, params: dict[str, Any] | None = None
) -> None:
    rows = list(api(args).list(path, params))
    if args.json:
        emit(args, rows)
    else:
        print_table(rows, COLUMNS[resource])


def emit(args: argparse.Namespace, data: Any) -> None:
    """An object as indented JSON (the API's own words: scripts can read it back)."""
    print(json.dumps(data, indent=None if args.json else 2, ensure_ascii=False))


def print_table(rows: Iterable[dict[str, Any]], columns: list[str]) -> None:
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    for line in [[c.upper() for c in columns], *cells]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def _parse_fields(pairs: list[str]) -> dict[str, Any]:
    fields = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise CliError(f"{pair!r}: write FIELD=VALUE", status=2)
        try:
            fields[name] = json.loads(raw)
        except ValueError:
            fields[name] = raw
    return fields


if __name__ == "__main__":
    sys.exit(main())
