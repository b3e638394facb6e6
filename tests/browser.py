"""Debian's Chromium for the browser tests: its flags, and navigation that survives a change
of the machine's network.

When an address appears or goes on any interface (another process creating or removing a
Docker network is enough), Chromium fails every request still waiting for a connection
with ``net::ERR_NETWORK_CHANGED``, before sending it, and retries none of them (its socket
pools flush on the change; no switch turns that off). A user would press reload; the tests
do the same for ``page.goto``: `tolerate_network_changes` makes every navigation retry on
that error, up to a deadline.
"""

from __future__ import annotations

import time
from typing import Any

# No background connections on this closed network (Chromium would try Google's hosts).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]

NETWORK_CHANGED = "net::ERR_NETWORK_CHANGED"
RETRY_SECONDS = 30.0


def goto_retrying(goto: Any, page: Any, url: str, **kwargs: Any) -> Any:
    """``goto(page, url)``, again while Chromium answers ERR_NETWORK_CHANGED (the request was
    never sent, so sending it again is what reloading would do)."""
    deadline = time.monotonic() + RETRY_SECONDS
    while True:
        try:
            return goto(page, url, **kwargs)
        except Exception as e:
            if NETWORK_CHANGED not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def tolerate_network_changes() -> None:
    """Every ``Page.goto`` of this process retries on ERR_NETWORK_CHANGED (idempotent)."""
    from playwright.sync_api import Page

    if getattr(Page.goto, "tolerates_network_changes", False):
        return
    goto = Page.goto

    def tolerant(self: Page, url: str, **kwargs: Any) -> Any:
        return goto_retrying(goto, self, url, **kwargs)

    tolerant.tolerates_network_changes = True  # type: ignore[attr-defined]
    Page.goto = tolerant  # type: ignore[method-assign]
