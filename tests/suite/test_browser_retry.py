"""tests/browser.py: a navigation Chromium failed with ERR_NETWORK_CHANGED (the machine's
network changed under it; the request was never sent) is made again; any other failure
is the test's to see."""

import pytest

from tests import browser


class Goto:
    """Stands in for Playwright's Page.goto: fails as told, then answers."""

    def __init__(self, *failures: str) -> None:
        self.failures = list(failures)
        self.calls = 0

    def __call__(self, page: object, url: str, **kwargs: object) -> str:
        self.calls += 1
        if self.failures:
            raise RuntimeError(f"Page.goto: {self.failures.pop(0)} at {url}")
        return f"response for {url}"


def test_a_navigation_cut_by_a_network_change_is_made_again() -> None:
    goto = Goto(browser.NETWORK_CHANGED, browser.NETWORK_CHANGED)
    assert browser.goto_retrying(goto, None, "http://127.0.0.1:1/login/") == (
        "response for http://127.0.0.1:1/login/"
    )
    assert goto.calls == 3


def test_other_failures_are_not_retried() -> None:
    goto = Goto("net::ERR_CONNECTION_REFUSED")
    with pytest.raises(RuntimeError, match="ERR_CONNECTION_REFUSED"):
        browser.goto_retrying(goto, None, "http://127.0.0.1:1/")
    assert goto.calls == 1


def test_a_network_that_keeps_changing_fails_after_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(browser, "RETRY_SECONDS", 0.3)
    goto = Goto(*[browser.NETWORK_CHANGED] * 1000)
    with pytest.raises(RuntimeError, match="ERR_NETWORK_CHANGED"):
        browser.goto_retrying(goto, None, "http://127.0.0.1:1/")
    assert 2 <= goto.calls < 1000
