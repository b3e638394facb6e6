"""tests/browser.py: a navigation Chromium failed with ERR_NETWORK_CHANGED (the machine's
network changed under it: the request was never sent, or its HTTP/2 connection was closed)
is made again until a deadline; any other failure is the test's to see."""

import time

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


def test_a_navigation_overtaken_by_an_error_page_is_made_again() -> None:
    goto = Goto('Navigation to "x" is interrupted by another navigation to "chrome-error://x"')
    assert browser.goto_retrying(goto, None, "http://127.0.0.1:1/").startswith("response")
    assert goto.calls == 2


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
    def __init__(
        self, frame: object, failure: str | None, navigation: bool = True, method: str = "POST"
    ) -> None:
        self.frame, self.failure, self.url = frame, failure, "https://127.0.0.1:1/login/"
        self.navigation, self.method = navigation, method

    def is_navigation_request(self) -> bool:
        return self.navigation


class FakePage:
    """Stands in for a Playwright page: a click's navigation fails as told (a failed
    request event, as Chromium reports it); its form holds what the user typed."""

    def __init__(self) -> None:
        self.main_frame = object()
        self.url = "https://127.0.0.1:1/login/"
        self.failures: list[Request] = []
        self.listeners: list[object] = []
        self.clicks = self.backs = 0
        self.typed = [["username", "admin", False, False], ["remember", "1", True, True]]
        self.restored: list = []
        self.gone_to: list[str] = []

    def on(self, event: str, listener: object) -> None:
        assert event == "requestfailed"
        self.listeners.append(listener)

    def remove_listener(self, event: str, listener: object) -> None:
        self.listeners.remove(listener)

    def wait_for_load_state(self, state: str) -> None:
        pass

    def wait_for_url(self, predicate: object, timeout: float) -> None:
        pass  # Chromium's error page for the failed navigation has come

    def goto(self, url: str) -> None:
        self.gone_to.append(url)
        self.backs += 1

    def evaluate(self, script: str, arg: object = None) -> object:
        if script == browser.SNAPSHOT_FIELDS:
            return self.typed
        assert script == browser.RESTORE_FIELDS
        self.restored.append(arg)
        return None


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
    assert page.restored == [page.typed]  # the form as the user had filled it
    assert page.listeners == []  # the page is left as it was


def test_a_redirect_cut_by_a_network_change_is_loaded_again_not_resubmitted() -> None:
    """The form's POST reached the server; the GET of its redirect failed: that GET is
    made again, and the form is not submitted a second time."""
    page = FakePage()
    page.failures = [Request(page.main_frame, browser.NETWORK_CHANGED, method="GET")]
    page.failures[0].url = "https://127.0.0.1:1/dashboard/"
    browser.click_retrying(click, page, "button")
    assert page.clicks == 1 and page.gone_to == ["https://127.0.0.1:1/dashboard/"]


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


def test_a_form_cut_again_and_again_is_submitted_until_it_goes_through() -> None:
    """Beside a loop creating containers, a login POST failed three times in a row over
    HTTP/2: a number of tries is not enough, the deadline is what counts."""
    page = FakePage()
    page.failures = [Request(page.main_frame, browser.NETWORK_CHANGED)] * 7
    browser.click_retrying(click, page, "button")
    assert (page.clicks, page.backs) == (8, 7)
    assert page.restored == [page.typed] * 7


def test_a_network_that_keeps_changing_stops_the_clicks_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(browser, "RETRY_SECONDS", 0.3)
    page = FakePage()
    page.failures = [Request(page.main_frame, browser.NETWORK_CHANGED)] * 100_000

    def slow_click(page: FakePage, selector: str, **kwargs: object) -> None:
        time.sleep(0.01)
        click(page, selector)

    browser.click_retrying(slow_click, page, "button")
    assert 2 <= page.clicks < 100
    assert page.backs == page.clicks - 1  # the last failure is left for the test to see


FORM = """<form method="post"><input type="hidden" name="csrf" value="fresh">
<input name="username"><input type="password" name="password">
<input type="checkbox" name="remember" value="1">
<input type="radio" name="role" value="admin"><input type="radio" name="role" value="member">
<select name="tenant"><option value="acme">Acme</option><option value="bravo">Bravo</option>
</select><textarea name="note"></textarea><button>Log in</button></form>"""


@pytest.mark.browser
def test_what_was_typed_comes_back_in_chromium() -> None:
    """The form snapshot and its restoring, in Debian's Chromium: typed values, boxes and
    choices come back on the page loaded again; hidden fields keep the page's own."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=browser.CHROMIUM_ARGS
        )
        try:
            page = chromium.new_page()
            page.set_content(FORM)
            page.fill("[name=username]", "admin")
            page.fill("[name=password]", "s3cret")
            page.check("[name=remember]")
            page.check("[name=role][value=member]")
            page.select_option("[name=tenant]", "bravo")
            page.fill("[name=note]", 'a "quoted" note')
            fields = page.evaluate(browser.SNAPSHOT_FIELDS)
            page.set_content(FORM.replace("fresh", "newer"))
            page.evaluate(browser.RESTORE_FIELDS, fields)
            assert page.input_value("[name=username]") == "admin"
            assert page.input_value("[name=password]") == "s3cret"
            assert page.is_checked("[name=remember]")
            assert page.is_checked("[name=role][value=member]")
            assert not page.is_checked("[name=role][value=admin]")
            assert page.input_value("[name=tenant]") == "bravo"
            assert page.input_value("[name=note]") == 'a "quoted" note'
            assert page.input_value("[name=csrf]") == "newer"
        finally:
            chromium.close()
