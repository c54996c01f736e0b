"""`rl ui`: the local web dashboard (issue #45) on Python's own HTTP server.

Why the standard library (`http.server.ThreadingHTTPServer`) and not a framework: the dashboard serves one user a
handful of JSON routes and static files from localhost; the standard library does that with no dependency to install
on GPU machines that often have no internet (the package needs nothing it does not already have), and nothing in it
changes under us. Why uPlot for the charts (rl/ui/static/vendor, MIT, 50 KB, pinned 1.6.32 from npm): canvas time
series that draw 100K points in milliseconds, no dependencies, shipped in the package (no CDN).

Safety (a dashboard on a shared host is a door into the run):
- bound to 127.0.0.1 unless `--host` says otherwise; the URL it prints carries a random token (as Jupyter's does),
  which the first request trades for an HttpOnly, SameSite=Strict cookie; every other request without the cookie or
  the token gets 403;
- a Host-header allow-list (127.0.0.1, localhost and `--allow-host` names, with the port) against DNS rebinding;
- every page is static: the data comes as JSON and the script puts it into the document as text (`textContent`),
  never as markup, under a Content-Security-Policy without inline script or style;
- read-only: GET and HEAD only; the runs' stores are opened read-only (rl/ui/data.py).
"""

from __future__ import annotations

import hmac
import json
import mimetypes
import secrets
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from rl.store.trajectories import StoreError
from rl.ui.data import Dashboard, UIError

COOKIE = "asyncrl_ui_token"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
STATIC = {"/": "index.html", "/index.html": "index.html", "/app.js": "app.js", "/app.css": "app.css",
          "/vendor/uPlot.iife.min.js": "vendor/uPlot.iife.min.js", "/vendor/uPlot.min.css": "vendor/uPlot.min.css"}


def _static(name: str) -> bytes:
    return resources.files("rl.ui").joinpath("static", *name.split("/")).read_bytes()


class Handler(BaseHTTPRequestHandler):
    server: "UIServer"
    server_version = "asyncrl-ui"
    sys_version = ""

    def log_message(self, format, *args) -> None:  # quiet: the terminal is the user's
        return

    def _send(self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj, allow_nan=False, default=str).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").strip().lower()
        return host in self.server.allowed_hosts

    def _token_ok(self, query: dict) -> tuple[bool, bool]:
        """(allowed, the token came in the URL: set the cookie)."""
        token = self.server.token
        given = (query.get("token") or [""])[0]
        if given and hmac.compare_digest(given, token):
            return True, True
        for part in (self.headers.get("Cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and hmac.compare_digest(value, token):
                return True, False
        return False, False

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True)
        if not self._host_ok():
            return self._error(HTTPStatus.FORBIDDEN, "Host header not allowed (start rl ui with --allow-host NAME)")
        ok, set_cookie = self._token_ok(query)
        if not ok:
            return self._error(HTTPStatus.FORBIDDEN, "open the URL rl ui printed (it carries the token)")
        if url.path in STATIC:
            name = STATIC[url.path]
            ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
            extra = {"Set-Cookie": f"{COOKIE}={self.server.token}; HttpOnly; SameSite=Strict; Path=/"} if set_cookie else {}
            return self._send(HTTPStatus.OK, _static(name), ctype + ("; charset=utf-8" if ctype.startswith("text/") or
                                                                     ctype.endswith("javascript") else ""), extra)
        if not url.path.startswith("/api/"):
            return self._error(HTTPStatus.NOT_FOUND, f"no page {url.path}")
        params = {k: v[-1] for k, v in query.items() if k != "token"}
        try:
            self._json(HTTPStatus.OK, self._api(url.path.removeprefix("/api/"), params))
        except (UIError, StoreError) as e:  # a bad filter, or a run without a (readable) store yet: one line
            self._error(HTTPStatus.BAD_REQUEST, str(e).splitlines()[0] if str(e) else type(e).__name__)
        except Exception as e:  # the page shows the line; the server goes on serving
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def _api(self, route: str, p: dict[str, str]):
        d = self.server.dashboard
        with self.server.lock:  # one request at a time on the stores' connections and the metrics caches
            if route == "runs":
                return d.runs_page()
            if route == "run":
                return d.run_page(p.get("run", ""))
            if route == "timeline":
                return d.timeline(p.get("run", ""))
            if route == "keys":
                return {"keys": d.keys(p.get("run", ""))}
            if route == "curve":
                return d.curve(p.get("run", ""), p.get("metric", ""))
            if route == "samples":
                return d.samples(p.get("run", ""), p)
            if route == "sample":
                return d.sample(p.get("run", ""), p.get("id", ""))
        raise UIError(f"no route /api/{route}")

    def do_POST(self) -> None:  # read-only: nothing to post
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "read-only")

    do_PUT = do_DELETE = do_PATCH = do_POST


class UIServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, dashboard: Dashboard, host: str = "127.0.0.1", port: int = 0, allow_hosts: tuple[str, ...] = (),
                 token: str | None = None):
        super().__init__((host, port), Handler)
        self.dashboard = dashboard
        self.token = token or secrets.token_urlsafe(24)
        self.lock = threading.Lock()
        port = self.server_address[1]
        names = {"127.0.0.1", "localhost", "[::1]", *allow_hosts}
        self.allowed_hosts = {f"{n.lower()}:{port}" for n in names} | ({n.lower() for n in names} if port == 80 else set())

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = "127.0.0.1" if host in ("127.0.0.1", "0.0.0.0") else host
        return f"http://{shown}:{port}/?token={self.token}"


def add_ui_parser(subparsers) -> None:
    p = subparsers.add_parser("ui", help="serve a local web dashboard of runs: curves, samples token by token")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR_OR_STORE_URL",
                   help="run directories (each holds metrics.jsonl and trajectories.db), or store URLs "
                        "(sqlite:///PATH, postgresql://...: every run of the store, curves from its RL train steps)")
    p.add_argument("--port", type=int, default=8765, help="port on the host (0: any free one); default 8765")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "reach it from elsewhere through an SSH port forward)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="another name the browser may use for this server in its Host header (e.g. a forwarded one)")
    p.set_defaults(func=cmd_ui)


def cmd_ui(args) -> int:
    import sys

    try:
        dashboard = Dashboard(args.run_dirs)
        server = UIServer(dashboard, args.host, args.port, tuple(args.allow_host))
    except (UIError, OSError) as e:
        print(f"rl ui: {e}", file=sys.stderr)
        return 2
    print(f"rl ui: serving {len(dashboard.runs)} run(s) at {server.url}", flush=True)
    threading.Thread(target=dashboard.warm, args=(server.lock,), name="rl-ui-warm", daemon=True).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        dashboard.close()
    return 0
