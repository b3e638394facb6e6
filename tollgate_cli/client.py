"""Where the admin API is and how to speak to it: the saved login and an httpx client that
turns problem+json answers into readable errors."""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class CliError(Exception):
    """Something to tell the user on stderr, with the exit status to end with."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def config_path() -> Path:
    """``$TOLLGATE_CONFIG``, else ``$XDG_CONFIG_HOME/tollgate/config.json`` (``~/.config``)."""
    if os.environ.get("TOLLGATE_CONFIG"):
        return Path(os.environ["TOLLGATE_CONFIG"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "tollgate" / "config.json"


def load_config() -> dict[str, str]:
    path = config_path()
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None


def save_config(url: str, token: str) -> Path:
    """Write the login readable by its owner only (0600, in a 0700 directory)."""
    path = config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token}, f)
        f.write("\n")
    os.chmod(path, 0o600)  # also when the file existed with wider permissions
    return path


@dataclass
class Api:
    """The admin API of one appliance, authenticated with an admin token."""

    url: str
    token: str | None

    @classmethod
    def from_settings(cls, url: str | None, token: str | None) -> "Api":
        """Flags win over ``TOLLGATE_URL``/``TOLLGATE_TOKEN``, which win over the saved login."""
        saved = load_config()
        url = url or os.environ.get("TOLLGATE_URL") or saved.get("url") or DEFAULT_URL
        token = token or os.environ.get("TOLLGATE_TOKEN") or saved.get("token")
        return cls(url=url.rstrip("/"), token=token)

    def client(self) -> httpx.Client:
        headers = {"Accept": "application/json", "User-Agent": "tollgate-cli"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return httpx.Client(base_url=self.url, headers=headers, timeout=TIMEOUT)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON answer (None for 204), or a CliError with the problem's words."""
        with self.client() as client:
            response = self._send(client, method, path, **kwargs)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    def list(self, path: str, params: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """Every row of a paginated list, following ``next`` links."""
        with self.client() as client:
            page = self._send(client, "GET", path, params=params).json()
            while True:
                yield from page["results"]
                if not page.get("next"):
                    return
                page = self._send(client, "GET", page["next"]).json()

    def download(self, path: str, params: dict[str, Any], out: Any) -> int:
        """Stream a CSV answer into ``out``; the number of bytes written."""
        written = 0
        with self.client() as client:
            try:
                with client.stream("GET", path, params=params) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise_for_problem(response)
                    for chunk in response.iter_text():
                        out.write(chunk)
                        written += len(chunk.encode())
            except httpx.TransportError as exc:
                raise self._unreachable(exc) from None
        return written

    def _send(self, client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        raise_for_problem(response)
        return response

    def _unreachable(self, exc: Exception) -> CliError:
        return CliError(f"cannot reach {self.url}: {exc}", status=2)


def raise_for_problem(response: httpx.Response) -> None:
    """A CliError made of the problem+json answer (or whatever the server said)."""
    if response.status_code < 400:
        return
    try:
        problem = response.json()
    except ValueError:
        problem = {}
    if not isinstance(problem, dict) or "status" not in problem:
        raise CliError(f"HTTP {response.status_code}: {response.text[:200]}")
    lines = [f"{problem.get('title', 'Error.')} ({response.status_code})"]
    errors = problem.get("errors") or []
    if errors:
        lines += [
            f"  {e['field']}: {e['message']}" if e.get("field") else f"  {e['message']}"
            for e in errors
        ]
    elif problem.get("detail"):
        lines.append(f"  {problem['detail']}")
    if response.status_code == 401:
        lines.append("  Log in with `tollgate login`, or set TOLLGATE_TOKEN.")
    raise CliError("\n".join(lines))
