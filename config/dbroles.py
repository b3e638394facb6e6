"""PostgreSQL roles: the gateway reads everything but writes only what serving needs.

The owner role (the one in ``DATABASE_URL``) runs migrations and every other process. The
gateway process — the part of Tollgate that faces tenants' requests on ``/v1`` — connects
as its own role, which may read every table but write only:

- the Batch API's files, batches and their lines (``/v1/files``, ``/v1/batches``);
- ``last_used_at`` of API keys (no other column of them);

so whoever takes over the gateway process cannot create, change or revoke tenants, API
keys, prices, users or anything else. Granted again after every migration (the ``migrate``
service runs ``manage.py db_roles``), so new tables are covered.
"""

from django.apps import apps
from django.db import connection
from psycopg import sql

from batches.models import Batch, BatchLine, File
from tenants.models import ApiKey

# Tables the gateway writes rows of, and single columns it may update elsewhere.
GATEWAY_WRITES = (File, Batch, BatchLine)
GATEWAY_COLUMNS = {ApiKey: ("last_used_at",)}


def _run(cur: object, statement: sql.Composable) -> None:
    cur.execute(statement.as_string(connection.connection))


def managed_tables() -> list[str]:
    """Every table of the project's models (Django's and the apps')."""
    return sorted(
        {m._meta.db_table for m in apps.get_models(include_auto_created=True) if m._meta.managed}
    )


def ensure_gateway_role(role: str, password: str | None) -> None:
    """Create or update ``role`` (LOGIN) and grant it exactly the gateway's privileges."""
    ident = sql.Identifier(role)
    with connection.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        verb = sql.SQL("ALTER") if cur.fetchone() else sql.SQL("CREATE")
        stmt = sql.SQL("{} ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT").format(
            verb, ident
        )
        if password:
            stmt = sql.SQL("{} PASSWORD {}").format(stmt, sql.Literal(password))
        _run(cur, stmt)
        db = sql.Identifier(connection.settings_dict["NAME"])
        _run(cur, sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(db, ident))
        _run(cur, sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(ident))
        tables = [sql.Identifier(t) for t in managed_tables()]
        every = sql.SQL(", ").join(tables)
        # Start from nothing, so a privilege given by hand or by an older version goes.
        _run(cur, sql.SQL("REVOKE ALL ON {} FROM {}").format(every, ident))
        _run(cur, sql.SQL("GRANT SELECT ON {} TO {}").format(every, ident))
        writable = sql.SQL(", ").join(sql.Identifier(m._meta.db_table) for m in GATEWAY_WRITES)
        _run(cur, sql.SQL("GRANT INSERT, UPDATE, DELETE ON {} TO {}").format(writable, ident))
        for model, columns in GATEWAY_COLUMNS.items():
            cols = sql.SQL(", ").join(map(sql.Identifier, columns))
            _run(
                cur,
                sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(
                    cols, sql.Identifier(model._meta.db_table), ident
                ),
            )
        _run(cur, sql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {}").format(ident))
