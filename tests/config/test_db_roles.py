"""The least-privilege PostgreSQL roles (config/dbroles.py) against the real server: the
gateway's reads everything and writes batches and API keys' last use, nothing else; the
application role (worker, batches, usage) reads and writes rows but never the schema."""

import secrets
from collections.abc import Iterator

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection

from tenants import services as tenant_services

pytestmark = pytest.mark.django_db(transaction=True)


def connect_as(role: str) -> psycopg.Connection:
    db = connection.settings_dict
    return psycopg.connect(
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        dbname=db["NAME"],
        user=role,
        autocommit=True,
    )


def drop_role(role: str) -> None:
    with connection.cursor() as cur:
        cur.execute(f'DROP OWNED BY "{role}"')
        cur.execute(f'DROP ROLE "{role}"')


@pytest.fixture
def gateway_db() -> Iterator[psycopg.Connection]:
    """A connection to the test database as a fresh gateway role (roles are cluster-wide:
    each run makes its own and drops it)."""
    role = f"tollgate_gw_{secrets.token_hex(4)}"
    call_command("db_roles", "--gateway-role", role)
    conn = connect_as(role)
    try:
        yield conn
    finally:
        conn.close()
        drop_role(role)


@pytest.fixture
def app_role() -> Iterator[str]:
    """A fresh application role (with the gateway role ``db_roles`` always refreshes)."""
    role, gateway = f"tollgate_app_{secrets.token_hex(4)}", f"tollgate_gw_{secrets.token_hex(4)}"
    call_command("db_roles", "--gateway-role", gateway, "--app-role", role)
    try:
        yield role
    finally:
        drop_role(role)
        drop_role(gateway)


def refused(conn: psycopg.Connection, statement: str) -> bool:
    try:
        conn.execute(statement)
    except psycopg.errors.InsufficientPrivilege:
        return True
    return False


def test_gateway_role_cannot_write_tenants_keys_or_prices(
    gateway_db: psycopg.Connection, tenant_a: object
) -> None:
    key_id = tenant_services.issue_api_key(None, tenant_a, name="k").key.pk
    assert gateway_db.execute("SELECT count(*) FROM tenants_tenant").fetchone()[0] >= 1
    for statement in (
        "UPDATE tenants_tenant SET name = 'owned'",
        "DELETE FROM tenants_tenant",
        "INSERT INTO tenants_tenant (name, slug) VALUES ('x', 'x')",
        "UPDATE tenants_apikey SET revoked_at = now()",
        "UPDATE tenants_apikey SET secret_hash = 'x'",
        "DELETE FROM tenants_apikey",
        "UPDATE metering_price SET output_per_mtok = 0",
        "DELETE FROM metering_price",
        "UPDATE auth_user SET is_superuser = true",
        "UPDATE deployments_deployment SET image = 'evil'",
        "CREATE TABLE owned (x int)",
    ):
        assert refused(gateway_db, statement), statement
    # What serving needs still works.
    gateway_db.execute("UPDATE tenants_apikey SET last_used_at = now() WHERE id = %s", [key_id])
    assert gateway_db.execute("SELECT count(*) FROM metering_price").fetchone()[0] >= 0
    gateway_db.execute(
        "INSERT INTO batches_file (public_id, tenant_id, filename, purpose, size, lines, content,"
        " created_at) VALUES ('file-gw', %s, 'in.jsonl', 'batch', 2, 1, '{}', now())",
        [tenant_a.pk],
    )
    gateway_db.execute("DELETE FROM batches_file WHERE public_id = 'file-gw'")


def test_app_role_writes_rows_but_never_the_schema(app_role: str, tenant_a: object) -> None:
    """What web, the worker, the batch runner and the usage consumer connect as
    (docs/operations/least-privilege.md): their work is rows; the schema is the migrations'
    alone."""
    key_id = tenant_services.issue_api_key(None, tenant_a, name="k").key.pk
    with connect_as(app_role) as app_db:
        # Rows of any table: what deployments, usage ingestion and batches write.
        app_db.execute("UPDATE tenants_tenant SET name = name WHERE id = %s", [tenant_a.pk])
        app_db.execute("UPDATE tenants_apikey SET last_used_at = now() WHERE id = %s", [key_id])
        app_db.execute(
            "INSERT INTO batches_file (public_id, tenant_id, filename, purpose, size, lines,"
            " content, created_at) VALUES ('file-app', %s, 'in.jsonl', 'batch', 2, 1, '{}', now())",
            [tenant_a.pk],
        )
        app_db.execute("DELETE FROM batches_file WHERE public_id = 'file-app'")
        assert app_db.execute("SELECT count(*) FROM django_migrations").fetchone()[0] > 0
        for statement in (
            "CREATE TABLE owned (x int)",
            "ALTER TABLE tenants_tenant ADD COLUMN owned int",
            "ALTER TABLE tenants_apikey DROP COLUMN secret_hash",
            "DROP TABLE metering_usageevent",
            "TRUNCATE metering_usageevent",
            "CREATE INDEX owned ON tenants_tenant (name)",
            "CREATE TRIGGER owned BEFORE UPDATE ON tenants_tenant"
            " FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()",
        ):
            assert refused(app_db, statement), statement
    # Still the schema it was.
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM metering_usageevent")
        cur.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_name = 'tenants_tenant' AND column_name = 'owned'"
        )
        assert cur.fetchone() is None


def test_db_roles_again_covers_new_tables_and_drops_hand_given_rights(app_role: str) -> None:
    """``migrate`` runs ``db_roles`` after every migration: a table a new release adds is
    reachable by the roles, and a right someone granted by hand goes."""
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE tollgate_test_new_table (x int)")
        cur.execute(f'GRANT TRUNCATE ON metering_usageevent TO "{app_role}"')
    try:
        with connect_as(app_role) as app_db:
            assert refused(app_db, "INSERT INTO tollgate_test_new_table VALUES (1)")
        call_command("db_roles", "--gateway-role", f"{app_role}_gw", "--app-role", app_role)
        with connect_as(app_role) as app_db:
            app_db.execute("INSERT INTO tollgate_test_new_table VALUES (1)")
            assert refused(app_db, "TRUNCATE metering_usageevent")
    finally:
        with connection.cursor() as cur:
            cur.execute("DROP TABLE tollgate_test_new_table")
        drop_role(f"{app_role}_gw")
