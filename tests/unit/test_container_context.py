"""The image's build context: code goes in; data, outputs, checkpoints, .venv, MLflow stores stay out.

What a build sends is computed by real Docker code, two ways: the docker CLI itself (`docker build`
with the classic builder, pointed at a socket here that only records the context tar it receives: no
Docker engine runs on this machine), and the Docker SDK for Python's `exclude_paths` (what docker-py
builds send). Both apply the .dockerignore to a tree with the files a real checkout accumulates, and to
this repository itself.
"""

import http.server
import io
import os
import shutil
import socketserver
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib
from docker.utils.build import exclude_paths

REPO_ROOT = Path(__file__).resolve().parents[2]

MUST_SEND = [
    "Dockerfile",
    "pyproject.toml",
    "README.md",
    "constraints/cpu.txt",
    "constraints/cuda.txt",
    "docker/entrypoint.sh",
    "docker/verify_stack.py",
    "launch/train.py",
    "ntil_ds/__init__.py",
    "ntil_ds/data/__init__.py",  # the library's data package is not the data/ folder
    "configs/train/tiny.yaml",
    "configs/deepspeed/zero3.json",
]
MUST_NOT_SEND = [
    "data/train.jsonl",
    "data/images/0.png",
    "outputs/run1/config.yaml",
    "outputs/run1/global_step10/mp_rank_00_model_states.pt",
    "checkpoints/step_100/model.safetensors",
    ".venv/bin/python",
    ".venv/lib/python3.11/site-packages/torch/__init__.py",
    "mlflow.db",
    "mlruns/0/meta.yaml",
    "launch/mlflow.db",  # a run started from inside launch/
    "launch/mlruns/0/meta.yaml",
    "launch/outputs/run2/config.yaml",
    "configs/train/checkpoints/step_1/model.safetensors",
    "ntil_ds/__pycache__/config.cpython-311.pyc",
    "ntil_ds.egg-info/PKG-INFO",
    ".git/HEAD",
    ".torch_extensions/py311_cpu/fused_adam/fused_adam.so",
    ".pytest_cache/v/cache/lastfailed",
    "tests/unit/test_something.py",
    "slurm/logs/ntil-123.out",
    "scratch/someones_big_file.bin",  # a folder nobody listed stays out too
]
# Top-level folders of this repository that may hold big or private files.
NEVER_SENT_ROOTS = [".venv", ".git", "data", "outputs", "checkpoints", "mlruns", ".torch_extensions", "tests"]


class _RecordBuildContext(http.server.BaseHTTPRequestHandler):
    """Answers the docker CLI like an engine with the classic builder, keeping the context tar it posts."""

    protocol_version = "HTTP/1.1"
    received: list[bytes]  # set per server

    def log_message(self, format, *args):
        pass

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _ping(self):
        self._reply(200, b"OK", {"API-Version": "1.47", "Builder-Version": "1", "OSType": "linux"})

    do_HEAD = _ping

    def do_GET(self):
        self._ping() if self.path.endswith("/_ping") else self._reply(404)

    def do_POST(self):
        body = b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.received.append(body)
        self._reply(200, b'{"stream":"context recorded\\n"}\r\n', {"Content-Type": "application/json"})


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):
        connection, _ = super().get_request()
        return connection, ("docker-cli", 0)  # BaseHTTPRequestHandler wants a (host, port) address


def context_via_docker_cli(context: Path) -> set[str]:
    """Files the docker CLI sends for `docker build <context>`."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI on this machine (the docker-py variant still runs)")
    socket_dir = Path(tempfile.mkdtemp(prefix="dkctx"))  # short: unix socket paths are limited to 108 bytes
    server = _UnixHTTPServer(str(socket_dir / "docker.sock"), _RecordBuildContext)
    server.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = dict(
            os.environ,
            DOCKER_HOST=f"unix://{socket_dir / 'docker.sock'}",
            DOCKER_BUILDKIT="0",  # the classic builder posts the whole context as one tar
            DOCKER_CONFIG=str(socket_dir / "config"),
        )
        result = subprocess.run(
            [docker, "build", "--quiet", str(context)], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(socket_dir)
    assert result.returncode == 0 and len(server.received) == 1, result.stderr
    with tarfile.open(fileobj=io.BytesIO(server.received[0]), mode="r:*") as tar:
        return {member.name for member in tar.getmembers() if member.isfile()}


def context_via_docker_py(context: Path) -> set[str]:
    """Files the Docker SDK for Python sends for `client.images.build(path=context)`."""
    lines = (context / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return {path for path in exclude_paths(str(context), patterns) if (context / path).is_file()}


LISTERS = [
    pytest.param(context_via_docker_cli, id="docker-cli"),
    pytest.param(context_via_docker_py, id="docker-py"),
]


@pytest.fixture
def cluttered_checkout(tmp_path: Path) -> Path:
    """This repo's Dockerfile and .dockerignore in a tree holding what runs leave behind."""
    for name in (".dockerignore", "Dockerfile"):
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    for relative in MUST_SEND + MUST_NOT_SEND:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(f"{relative}\n")
    return tmp_path


@pytest.mark.parametrize("list_context", LISTERS)
def test_context_sends_code_and_leaves_out_runs(list_context: Callable[[Path], set[str]], cluttered_checkout):
    sent = list_context(cluttered_checkout)
    assert sorted(set(MUST_SEND) - sent) == [], "the image build needs these"
    assert sorted(set(MUST_NOT_SEND) & sent) == [], "these must not be sent to the builder"


@pytest.mark.parametrize("list_context", LISTERS)
def test_this_repository_context_has_what_the_dockerfile_copies(list_context: Callable[[Path], set[str]]):
    sent = list_context(REPO_ROOT)
    sent_roots = {path.split("/", 1)[0] for path in sent}
    assert sorted(sent_roots & set(NEVER_SENT_ROOTS)) == []

    dockerfile = (REPO_ROOT / "Dockerfile").read_text().splitlines()
    copy_sources = [
        line.split()[-2].rstrip("/")
        for line in dockerfile
        if line.startswith("COPY ") and "--from=" not in line and line.split()[-2] != "."
    ]
    readme = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["readme"]
    needed = [*copy_sources, readme, "docker/entrypoint.sh", "launch", "ntil_ds", "configs"]
    missing = [path for path in needed if not any(f == path or f.startswith(f"{path}/") for f in sent)]
    assert missing == [], f"the Dockerfile needs these in the build context: {missing}"
