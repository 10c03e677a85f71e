"""A real ``mlflow server`` on loopback with a sqlite backend, for the tests that need a tracking server.

Open, or behind MLflow's basic-auth app (``mlflow server --app-name basic-auth``, as docs/tracking.md
sets one up) with one user, the server's admin, whose credentials the test gives the job.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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
