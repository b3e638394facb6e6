"""Console test helpers: Django test clients logged in as the named users of tests/conftest.py."""

from collections.abc import Callable

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client


@pytest.fixture
def web(db: None) -> Callable[[AbstractBaseUser], Client]:
    """A browser-like client with a console session for the user."""

    def make(user: AbstractBaseUser) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make
