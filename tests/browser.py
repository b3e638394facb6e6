"""Debian's Chromium for the browser tests: its flags, and navigation that survives a change
of the machine's network.

When an address appears or goes on any interface (another process creating or removing a
Docker network or container is enough), Chromium fails every request still waiting for a
connection with ``net::ERR_NETWORK_CHANGED`` and retries none of them (its socket pools
flush on the change; no switch turns that off). Over HTTP/2 (the appliance's HTTPS front)
it also closes the connection itself ("Closing current sessions." in its net log), failing
the requests already sent on it: a form's POST may then have reached the server. Beside a
loop that creates containers (scripts/docker-churn) that happens about once a second, and a
login POST that takes half a second on a loaded machine failed three times in a row.

A user would press reload (or open the form again and submit it, which for the forms these
tests submit over HTTP/2, the login, does no harm twice); the tests do the same, until a
deadline rather than a number of times: `tolerate_network_changes` makes every
``page.goto`` retry on that error, and every ``page.click`` whose navigation failed with it
load the page it left again, with what was typed into its form, and click again.
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
# A navigation overtaken by the error page of one that just failed (that way, or another).
INTERRUPTED_BY_ERROR_PAGE = 'is interrupted by another navigation to "chrome-error://'
RETRY_SECONDS = 30.0


def goto_retrying(goto: Any, page: Any, url: str, **kwargs: Any) -> Any:
    """``goto(page, url)``, again while Chromium answers ERR_NETWORK_CHANGED (the request was
    never sent, so sending it again is what reloading would do)."""
    deadline = time.monotonic() + RETRY_SECONDS
    while True:
        try:
            return goto(page, url, **kwargs)
        except Exception as e:
            cut = NETWORK_CHANGED in str(e) or INTERRUPTED_BY_ERROR_PAGE in str(e)
            if not cut or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


# What the user typed into the page's form fields (hidden ones, such as the CSRF token, come
# fresh with the page), and putting it back.
SNAPSHOT_FIELDS = """() => Array.from(document.querySelectorAll('input, textarea, select'))
  .filter(e => e.name && !['hidden', 'file', 'submit', 'button'].includes(e.type))
  .map(e => ['checkbox', 'radio'].includes(e.type)
    ? [e.name, e.value, e.checked, true] : [e.name, e.value, false, false])"""
RESTORE_FIELDS = """(fields) => { for (const [name, value, checked, box] of fields) {
  const sel = box ? `[name="${CSS.escape(name)}"][value="${CSS.escape(value)}"]`
                  : `[name="${CSS.escape(name)}"]`;
  const e = document.querySelector(sel);
  if (!e) continue;
  if (box) e.checked = checked; else e.value = value;
} }"""


def click_retrying(click: Any, page: Any, selector: str, **kwargs: Any) -> None:
    """``click(page, selector)``; while the navigation it started (a form's POST, a link)
    fails with ERR_NETWORK_CHANGED, up to RETRY_SECONDS: load the page it left again, put
    back what had been typed into its form fields, and click again."""
    failed: list[tuple[str, str]] = []  # (method, URL) of the navigation that failed

    def note(request: Any) -> None:
        if (
            request.is_navigation_request()
            and request.frame == page.main_frame
            and NETWORK_CHANGED in (request.failure or "")
        ):
            failed.append((request.method, request.url))

    deadline = time.monotonic() + RETRY_SECONDS
    page.on("requestfailed", note)
    try:
        while True:
            failed.clear()
            left, fields = page.url, _snapshot(page)
            click(page, selector, **kwargs)
            page.wait_for_load_state("domcontentloaded")  # the navigation, if any, is over
            if not failed or time.monotonic() >= deadline:
                return
            _settle_on_error_page(page)
            method, url = failed[-1]
            if method == "GET":
                # What failed was a GET (a link, or the redirect after a form's POST, which
                # the server did receive): load it again, do not submit anything twice.
                page.goto(url)
                return
            page.goto(left)
            if fields:
                page.evaluate(RESTORE_FIELDS, fields)
    finally:
        page.remove_listener("requestfailed", note)


def _settle_on_error_page(page: Any) -> None:
    """Let Chromium commit its error page for the failed navigation first: a navigation
    started before that is interrupted by it."""
    try:
        page.wait_for_url(lambda url: url.startswith("chrome-error://"), timeout=10_000)
    except Exception:  # noqa: BLE001 - no error page came: nothing to wait for
        pass


def _snapshot(page: Any) -> list | None:
    try:
        return page.evaluate(SNAPSHOT_FIELDS)
    except Exception:  # noqa: BLE001 - mid-navigation, or no document: nothing to put back
        return None


def tolerate_network_changes() -> None:
    """Every ``Page.goto`` and ``Page.click`` of this process survives ERR_NETWORK_CHANGED
    (idempotent)."""
    from playwright.sync_api import Page

    if getattr(Page.goto, "tolerates_network_changes", False):
        return
    goto, click = Page.goto, Page.click

    def tolerant_goto(self: Page, url: str, **kwargs: Any) -> Any:
        return goto_retrying(goto, self, url, **kwargs)

    def tolerant_click(self: Page, selector: str, **kwargs: Any) -> None:
        click_retrying(click, self, selector, **kwargs)

    tolerant_goto.tolerates_network_changes = True  # type: ignore[attr-defined]
    Page.goto = tolerant_goto  # type: ignore[method-assign]
    Page.click = tolerant_click  # type: ignore[method-assign]
