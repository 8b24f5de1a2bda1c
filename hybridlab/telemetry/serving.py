"""Serving dashboards: one run's page or a runs page, on localhost or behind Panel's own login.

The page binds to localhost by default. Any other address needs Panel's authentication: a
``basic_auth`` password file (JSON ``{"user": "password"}``) or one of Panel's OAuth providers
(``oauth_provider`` with ``PANEL_OAUTH_KEY`` / ``PANEL_OAUTH_SECRET`` in the environment);
without one, ``check_serving`` refuses and says how. The run controls (pause, resume, stop,
the stack dump) show for a browser on the same machine (loopback) and, elsewhere, only for a
logged-in user.
"""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
from pathlib import Path

from hybridlab.errors import UserError
from hybridlab.telemetry.dashboard import build_dashboard
from hybridlab.telemetry.hub import TELEMETRY_FILE
from hybridlab.telemetry.runs import build_runs_page

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(address: str) -> bool:
    """Return whether ``address`` (a host name or IP) only reaches this machine."""
    if address in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def check_serving(address: str, basic_auth: str | None, oauth_provider: str | None) -> None:
    """Refuse to serve on a non-loopback ``address`` without authentication, and a password
    file that is missing or not a JSON object of user -> password; returns nothing."""
    if basic_auth:
        path = Path(basic_auth)
        if not path.is_file():
            raise UserError(f"--basic-auth: no password file {basic_auth!r} (a JSON object {{\"user\": \"password\"}})")
        try:
            users = json.loads(path.read_text())
        except ValueError as exc:
            raise UserError(f"--basic-auth: {basic_auth} is not JSON ({exc}); write {{\"user\": \"password\"}}") from exc
        if not isinstance(users, dict) or not users or not all(isinstance(v, str) and v for v in users.values()):
            raise UserError(f"--basic-auth: {basic_auth} must map each user name to a non-empty password")
    if not is_loopback(address) and not basic_auth and not oauth_provider:
        raise UserError(f"serving on {address} makes the page reachable from other machines: give --basic-auth"
                        " PASSWORD_FILE (JSON {\"user\": \"password\"}) or --oauth-provider NAME (Panel's OAuth,"
                        " with PANEL_OAUTH_KEY and PANEL_OAUTH_SECRET set), or serve on localhost and use an"
                        " SSH tunnel")


def control_allowed() -> bool:
    """Return whether the page being built may offer control actions: a logged-in user, or a
    browser connecting from this machine."""
    import panel as pn

    if pn.state.user:
        return True
    try:
        remote = pn.state.curdoc.session_context.request.remote_ip
    except AttributeError:  # not served (a notebook cell): the kernel's own user
        return True
    return bool(remote) and is_loopback(remote)


def free_port(address: str = "localhost") -> int:
    """Return a TCP port that is free on ``address`` now."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def is_runs_root(path: str | Path) -> bool:
    """Return whether ``path`` is a folder of runs rather than one run's directory."""
    path = Path(path)
    return not (path / TELEMETRY_FILE).is_file() and not (path / "config.yaml").is_file()


def serve(target: str | Path, port: int = 0, address: str = "localhost", show: bool = False,
          threaded: bool = False, basic_auth: str | None = None, oauth_provider: str | None = None):
    """Serve the dashboard of run directory ``target``, or the runs page when it is a folder of
    runs, on ``address:port`` (0 picks a free port); returns (server or server thread, port).
    ``threaded=True`` returns at once (notebooks, tests)."""
    import panel as pn

    check_serving(address, basic_auth, oauth_provider)
    port = port or free_port(address)
    hosts = {address, "localhost", "127.0.0.1"} | (set() if is_loopback(address) else {socket.gethostname()})
    origins = sorted(f"{h}:{port}" for h in hosts)  # browsers on other machines use this machine's name
    runs = is_runs_root(target)
    if runs:
        app = lambda: build_runs_page(target, template=True)  # noqa: E731
    else:
        app = lambda: build_dashboard(target, control=control_allowed(), template=True)  # noqa: E731
    auth = {}
    if basic_auth or oauth_provider:
        auth = {"basic_auth": basic_auth, "oauth_provider": oauth_provider,
                "cookie_secret": os.environ.get("PANEL_COOKIE_SECRET") or secrets.token_hex(32)}
    title = f"hybridlab {'runs in ' if runs else ''}{Path(target).name}"
    server = pn.serve({"/": app}, port=port, address=address, show=show, threaded=threaded, title=title,
                      websocket_origin=origins, verbose=False, **auth)
    return server, port
