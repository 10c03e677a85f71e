"""A real ``mlflow server`` on loopback with a sqlite backend, for the tests that need a tracking server.

Open, or behind MLflow's basic-auth app (``mlflow server --app-name basic-auth``, as docs/tracking.md
sets one up) with one user, the server's admin, whose credentials the test gives the job.
"""

from __future__ import annotations

import base64
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` with a sqlite backend on loopback, in its own process group (it forks uvicorn).

    ``credentials=(user, password)``: the basic-auth app, where nobody else may read or write, and
    requests without those credentials get 401. ``uri`` never holds the credentials.
    """

    def __init__(self, root: Path, credentials: tuple[str, str] | None = None) -> None:
        self.root = root
        self.credentials = credentials
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 240) -> None:
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'server.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        # The server's background job runner is not needed and costs CPU on a 2-core machine.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        if self.credentials is not None:
            user, password = self.credentials
            config = self.root / "basic_auth.ini"
            config.write_text(
                "[mlflow]\n"
                "default_permission = NO_PERMISSIONS\n"
                f"database_uri = sqlite:///{self.root / 'basic_auth.db'}\n"
                "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            )
            cmd += ["--app-name", "basic-auth"]
            env.update(
                MLFLOW_AUTH_CONFIG_PATH=str(config),
                MLFLOW_AUTH_ADMIN_USERNAME=user,
                MLFLOW_AUTH_ADMIN_PASSWORD=password,
                # Signs the UI's CSRF tokens; the app refuses to start without one.
                MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16),
            )
        log = (self.root / "server.log").open("ab")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=log, cwd=self.root, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"mlflow server did not answer in {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL the whole server (a crash, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


class SigningProxy:
    """A loopback HTTP proxy that adds the server's basic-auth credentials to every request, as a
    reverse proxy with its own login would.

    For the browser: a page whose address holds credentials (``http://user:pw@host/``) loads, but the
    MLflow UI's requests from it fail ("Request cannot be constructed from a URL that includes
    credentials"), and headless Chromium has no other way to be given a password.
    """

    def __init__(self, server: MlflowServer) -> None:
        user, password = server.credentials
        authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        upstream = server.uri

        class Forward(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                request = urllib.request.Request(
                    upstream + self.path, data=body, method=self.command, headers=headers
                )
                request.add_header("Authorization", authorization)
                try:
                    response = urllib.request.urlopen(request, timeout=60)
                except urllib.error.HTTPError as error:
                    response = error
                with response:
                    payload = response.read()
                    self.send_response(response.status)
                    for key, value in response.headers.items():
                        if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _forward

            def log_message(self, *args) -> None:  # quiet: the test reads its own output
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.uri = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> SigningProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
