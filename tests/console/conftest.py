"""Console test helpers: Django test clients logged in as the named users of tests/conftest.py."""

from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.db import connections
from django.test import Client


@pytest.fixture
def web(db: None) -> Callable[[AbstractBaseUser], Client]:
    """A browser-like client with a console session for the user."""

    def make(user: AbstractBaseUser) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make


@pytest.fixture
def chromium(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Debian's Chromium, headless, driven by Playwright (tests/browser.py: its flags, and
    navigation that survives another process changing the machine's network)."""
    from playwright.sync_api import sync_playwright

    from tests.browser import CHROMIUM_ARGS, tolerate_network_changes
    from tests.console.test_browser import SHOTS

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    SHOTS.mkdir(parents=True, exist_ok=True)
    tolerate_network_changes()
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()
            # Inside sync_playwright() the ORM runs in another context, on connections of its
            # own that pytest-django does not know about: close them, or they stay open and
            # keep the test database from being dropped.
            connections.close_all()
