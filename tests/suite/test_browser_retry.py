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


class Request:
    def __init__(self, frame: object, failure: str | None, navigation: bool = True) -> None:
        self.frame, self.failure, self.url = frame, failure, "https://127.0.0.1:1/login/"
        self.navigation = navigation

    def is_navigation_request(self) -> bool:
        return self.navigation


class FakePage:
    """Stands in for a Playwright page: a click's navigation fails as told (a failed
    request event, as Chromium reports it), going back returns to the form."""

    def __init__(self) -> None:
        self.main_frame = object()
        self.failures: list[Request] = []
        self.listeners: list[object] = []
        self.clicks = self.backs = 0

    def on(self, event: str, listener: object) -> None:
        assert event == "requestfailed"
        self.listeners.append(listener)

    def remove_listener(self, event: str, listener: object) -> None:
        self.listeners.remove(listener)

    def wait_for_load_state(self, state: str) -> None:
        pass

    def go_back(self) -> None:
        self.backs += 1


def click(page: FakePage, selector: str, **kwargs: object) -> None:
    page.clicks += 1
    failure = page.failures.pop(0) if page.failures else None
    if failure is not None:
        for listener in page.listeners:
            listener(failure)


def test_a_form_post_cut_by_a_network_change_is_submitted_again() -> None:
    page = FakePage()
    page.failures = [Request(page.main_frame, browser.NETWORK_CHANGED)]
    browser.click_retrying(click, page, "button")
    assert (page.clicks, page.backs) == (2, 1)
    assert page.listeners == []  # the page is left as it was


def test_other_failures_and_other_frames_are_the_tests_to_see() -> None:
    page = FakePage()
    page.failures = [
        Request(page.main_frame, "net::ERR_CONNECTION_REFUSED"),
    ]
    browser.click_retrying(click, page, "button")
    assert (page.clicks, page.backs) == (1, 0)
    page = FakePage()
    page.failures = [Request(object(), browser.NETWORK_CHANGED)]  # an iframe's
    browser.click_retrying(click, page, "button")
    assert (page.clicks, page.backs) == (1, 0)
    page = FakePage()
    page.failures = [Request(page.main_frame, browser.NETWORK_CHANGED, navigation=False)]
    browser.click_retrying(click, page, "button")  # a fetch/htmx request: not a navigation
    assert (page.clicks, page.backs) == (1, 0)


def test_a_network_that_keeps_changing_gets_three_clicks() -> None:
    page = FakePage()
    page.failures = [Request(page.main_frame, browser.NETWORK_CHANGED)] * 5
    browser.click_retrying(click, page, "button")
    assert (page.clicks, page.backs) == (3, 2)
