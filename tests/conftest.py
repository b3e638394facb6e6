"""Shared fixtures: the four named users by role, their tenants, and API clients.

- ``alice``: tenant A admin        - ``bob``: tenant A member
- ``carol``: tenant B admin        - ``root``: platform admin (staff)

Every API test uses these, so each one can check that tenant B sees nothing of tenant A.
Tests run against the real PostgreSQL and Redis (see scripts/test).
"""

import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from rest_framework.test import APIClient

from core.redis import get_redis
from deployments import services as deployment_services
from deployments.choices import Visibility
from deployments.models import CatalogModel, Node
from tenants import services
from tenants.choices import Role
from tenants.models import Tenant
from tests import leaks

User = get_user_model()
PASSWORD = "correct horse battery staple 42"


@pytest.fixture(autouse=True)
def redis_namespace(settings: object) -> Iterator[str]:
    """Each test writes Redis keys under its own prefix, removed afterwards."""
    prefix = f"tollgate-test-{uuid.uuid4().hex[:12]}"
    settings.TOLLGATE_REDIS_PREFIX = prefix
    yield prefix
    client = get_redis()
    keys = list(client.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def tenant_a(db: None) -> Tenant:
    return services.create_tenant(None, name="Acme Research", slug="acme")


@pytest.fixture
def tenant_b(db: None) -> Tenant:
    return services.create_tenant(None, name="Bravo Labs", slug="bravo")


def _user(username: str, is_staff: bool = False) -> AbstractBaseUser:
    return User.objects.create_user(
        username, f"{username}@example.test", PASSWORD, is_staff=is_staff
    )


@pytest.fixture
def alice(tenant_a: Tenant) -> AbstractBaseUser:
    """Tenant A admin."""
    user = _user("alice")
    services.add_member(None, tenant_a, user, Role.ADMIN)
    return user


@pytest.fixture
def bob(tenant_a: Tenant) -> AbstractBaseUser:
    """Tenant A member."""
    user = _user("bob")
    services.add_member(None, tenant_a, user, Role.MEMBER)
    return user


@pytest.fixture
def carol(tenant_b: Tenant) -> AbstractBaseUser:
    """Tenant B admin."""
    user = _user("carol")
    services.add_member(None, tenant_b, user, Role.ADMIN)
    return user


@pytest.fixture
def root(db: None) -> AbstractBaseUser:
    """Platform admin."""
    return _user("root", is_staff=True)


@pytest.fixture
def client_for(db: None) -> Callable[[AbstractBaseUser], APIClient]:
    """An API client authenticated the way scripts are: with the user's admin API token."""

    def make(user: AbstractBaseUser) -> APIClient:
        issued = services.issue_admin_token(user, name="tests")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.plaintext}")
        return client

    return make


@pytest.fixture
def public_model(db: None) -> CatalogModel:
    return deployment_services.create_model(
        None,
        served_name="qwen3-8b",
        source="Qwen/Qwen3-8B",
        params_billions=Decimal("8.2"),
        context_length=32768,
    )


@pytest.fixture
def private_model_a(tenant_a: Tenant) -> CatalogModel:
    """A private model granted to tenant A only."""
    model = deployment_services.create_model(
        None,
        served_name="acme-secret-70b",
        source="acme/secret-70b",
        params_billions=Decimal("70"),
        context_length=131072,
        visibility=Visibility.PRIVATE,
    )
    deployment_services.grant_model(None, model, tenant_a)
    return model


@pytest.fixture
def stack_volumes() -> tuple[str, str] | None:
    """Existing (model cache, compile cache) volumes for tests/deployments' ``stack`` fixture
    to use instead of its own empty ones (here, so every folder that borrows ``stack`` has
    it); tests/vllm overrides it with the staged test model's volumes."""
    return None


@pytest.fixture
def local_node(db: None) -> Node:
    return deployment_services.register_node(
        None,
        name="spark-1",
        docker_url="tcp://docker-proxy:2375",
        total_memory_bytes=128 * 2**30,
        unified_memory=True,
        gpu_description="NVIDIA GB10",
        gpu_count=1,
    )


# --- nothing left behind -----------------------------------------------------------------

# Sessions that run any of these start containers, networks or volumes. Other processes on
# the machine may too, meanwhile: only this run's own objects count (tests/leaks.py, RUN).
DOCKER_MARKERS = ("docker", "browser", "slow", "compose", "faults", "vllm", "arm64")


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the stage if the session leaves child processes or Docker objects of its run
    behind that were not there when it started (set up first, so torn down after every other
    fixture)."""
    processes = {p.pid for p in leaks.live_descendants()}
    uses_docker = any(
        item.get_closest_marker(m) for item in request.session.items for m in DOCKER_MARKERS
    )
    client = leaks.docker_client() if uses_docker else None
    objects = leaks.docker_objects(client) if client else set()
    yield
    grace = leaks.grace_seconds()
    left = leaks.settle(lambda: leaks.leftover_processes(processes), grace)
    if left:
        leaks.end_processes(processes)
    if client:
        left += leaks.settle(lambda: sorted(leaks.docker_objects(client) - objects), grace)
    if left:
        pytest.fail("the test session left behind:\n  " + "\n  ".join(left), pytrace=False)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: object) -> Iterator[None]:
    """pytest-django's test database, and at the end a check that no other session is still
    connected to it (they would also keep it from being dropped)."""
    yield
    from django.db import connection

    with django_db_blocker.unblock():
        left = leaks.settle(lambda: leaks.other_db_sessions(connection), leaks.grace_seconds())
        if left:
            leaks.end_db_sessions(connection)
        connection.close()
    if left:
        pytest.fail(
            "the test session left connections to the test database open:\n  " + "\n  ".join(left),
            pytrace=False,
        )
