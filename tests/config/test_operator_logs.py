"""What an operator reads in the web process's log: nothing alarming at start, one line per
refused request, no warning for static files; and the console has a favicon."""

import re
import time
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model

from tests.conftest import PASSWORD
from tests.liveserver import serve

pytestmark = pytest.mark.django_db(transaction=True)


def _login(client: httpx.Client, username: str) -> None:
    page = client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    answer = client.post(
        "/login/",
        data={"username": username, "password": PASSWORD, "csrfmiddlewaretoken": token},
        headers={"Referer": f"{client.base_url}/login/"},
    )
    assert answer.status_code == 302, answer.text[:500]


def test_start_static_files_and_a_refusal_log_nothing_but_one_line(tmp_path: Path) -> None:
    get_user_model().objects.create_user("member", "m@example.test", PASSWORD)
    home = tmp_path / "home"
    home.mkdir()
    with serve(tmp_path / "web.log", HOME=str(home)) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            css = client.get("/static/console/console.css")
            assert css.status_code == 200 and "--accent" in css.text
            icon = client.get("/favicon.ico", follow_redirects=True)
            assert icon.status_code == 200 and icon.text.startswith("<svg")
            assert 'rel="icon"' in client.get("/login/").text
            _login(client, "member")
            assert client.get("/dashboard/").status_code == 403
        # The refusal is logged after its answer has gone out: wait for the line.
        deadline = time.monotonic() + 30
        while "Forbidden" not in server.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = server.log_text()
    # gunicorn's control socket is off: no $HOME/.gunicorn, no "Control server error".
    assert not (home / ".gunicorn").exists()
    assert "Control server" not in log, log
    assert "StreamingHttpResponse" not in log, log
    refusals = [line for line in log.splitlines() if "Forbidden" in line]
    assert len(refusals) == 1 and "/dashboard/" in refusals[0], log
    assert "Traceback" not in log, log
