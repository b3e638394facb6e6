"""The gateway's PostgreSQL role (config/dbroles.py) against the real server: it reads
everything, writes batches and API keys' last use, and nothing else."""

import secrets
from collections.abc import Iterator

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection

from tenants import services as tenant_services

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def gateway_db() -> Iterator[psycopg.Connection]:
    """A connection to the test database as a fresh gateway role (roles are cluster-wide:
    each run makes its own and drops it)."""
    role = f"tollgate_gw_{secrets.token_hex(4)}"
    call_command("db_roles", "--gateway-role", role)
    db = connection.settings_dict
    conn = psycopg.connect(
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        dbname=db["NAME"],
        user=role,
        autocommit=True,
    )
    try:
        yield conn
    finally:
        conn.close()
        with connection.cursor() as cur:
            cur.execute(f'DROP OWNED BY "{role}"')
            cur.execute(f'DROP ROLE "{role}"')


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
