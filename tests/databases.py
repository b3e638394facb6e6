"""The test database as a URL, for the processes tests start (gateway, workers, containers)."""

from django.db import connection


def database_url(host: str | None = None, port: int | None = None) -> str:
    """postgres:// URL of the test database, optionally as another host or port reaches it."""
    db = connection.settings_dict
    auth = (db["USER"] or "postgres") + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return (
        f"postgres://{auth}@{host or db['HOST'] or '127.0.0.1'}:"
        f"{port or db['PORT'] or 5432}/{db['NAME']}"
    )
