"""PostgreSQL roles: only migrations change the schema; the gateway writes only what serving needs.

The owner role (the one in ``DATABASE_URL``; a superuser of the appliance's bundled
database) runs migrations, in the one-shot ``migrate`` service. Every long-running process
holds less:

- the **application role** (``tollgate_app`` in the appliance), for the console and admin
  API (``web``), the worker, the batch runner and the usage consumer: it reads and writes
  rows of every table, and nothing more — no ``CREATE``, ``ALTER``, ``DROP``, ``TRUNCATE``
  or triggers — so whoever takes over one of those processes cannot change or destroy the
  schema, nor run commands on the database server as a superuser could;
- the **gateway role**, for the process that faces tenants' requests on ``/v1``: it may read
  every table but write only the Batch API's files, batches and their lines (``/v1/files``,
  ``/v1/batches``) and ``last_used_at`` of API keys (no other column of them), so whoever
  takes over the gateway process cannot create, change or revoke tenants, API keys, prices,
  users or anything else.

Granted again after every migration (the ``migrate`` service runs ``manage.py db_roles``),
so new tables are covered.
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


def _login_role(cur: object, role: str, password: str | None) -> sql.Identifier:
    """Create or update ``role`` (LOGIN, no other attribute), able to connect, with no
    privilege on any table yet: one given by hand or by an older version goes."""
    ident = sql.Identifier(role)
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
    _run(cur, sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {}").format(ident))
    _run(cur, sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {}").format(ident))
    return ident


def ensure_app_role(role: str, password: str | None) -> None:
    """Create or update ``role`` with rights on rows of every table, none on the schema."""
    with connection.cursor() as cur:
        ident = _login_role(cur, role, password)
        _run(
            cur,
            sql.SQL(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}"
            ).format(ident),
        )
        _run(cur, sql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {}").format(ident))


def ensure_gateway_role(role: str, password: str | None) -> None:
    """Create or update ``role`` and grant it exactly the gateway's privileges."""
    with connection.cursor() as cur:
        ident = _login_role(cur, role, password)
        every = sql.SQL(", ").join(sql.Identifier(t) for t in managed_tables())
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
