"""docker/entrypoint.sh: `train ...` runs launch/train.py under the real deepspeed / torchrun launcher,
anything else runs as given.

The launchers are real (2 CPU processes); launch/train.py is a stand-in that prints what each rank
received, so the test checks the entry point and launcher, not the trainer (its own tests do that).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO_ROOT / "docker" / "entrypoint.sh"
ENTRYPOINT_SETTINGS = ("NTIL_LAUNCHER", "NTIL_HOME", "NPROC_PER_NODE", "MASTER_PORT")
TRAIN_ARGS = ["--config", "configs/train/tiny.yaml", "optim.lr=1e-4", "run name=with space"]

# One write per line: the deepspeed launcher runs ranks with `python -u`, where print() writes the text
# and its newline separately and two ranks' lines can interleave.
RANK_REPORTER = """\
import json, os, sys
report = {"argv": sys.argv[1:], "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"]}
sys.stdout.write(json.dumps(report) + "\\n")
"""


def run_entrypoint(*args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
    # As in the image, the venv's launchers are on PATH; the caller's own entry-point settings are not.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    inherited = {key: value for key, value in os.environ.items() if key not in ENTRYPOINT_SETTINGS}
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args],
        env={**inherited, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def project_home(tmp_path: Path) -> Path:
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "train.py").write_text(RANK_REPORTER)
    return tmp_path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_reports(stdout: str) -> dict[str, dict]:
    reports = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"argv"')]
    return {report["rank"]: report for report in reports}


def test_help_and_no_arguments_print_usage():
    for args in (["help"], []):
        result = run_entrypoint(*args)
        assert result.returncode == 0
        assert "NTIL_LAUNCHER" in result.stdout and "launch/train.py" in result.stdout


def test_other_commands_run_as_given_with_their_arguments_intact():
    result = run_entrypoint("python", "-c", "import sys; print(sys.argv[1:])", "a b", "--config", "x=1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['a b', '--config', 'x=1']"


def test_bad_launcher_or_missing_trainer_fail_at_once_with_a_reason(project_home, tmp_path):
    result = run_entrypoint(
        "train", "--config", "x.yaml", NTIL_LAUNCHER="mpirun", NTIL_HOME=str(project_home)
    )
    assert result.returncode == 2
    assert "NTIL_LAUNCHER must be 'deepspeed' or 'torchrun', not 'mpirun'" in result.stderr

    result = run_entrypoint("--config", "x.yaml", NTIL_HOME=str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "launch/train.py not found: set NTIL_HOME" in result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_is_clean():
    result = subprocess.run(["shellcheck", str(ENTRYPOINT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_torchrun_starts_every_rank_with_the_training_arguments(project_home):
    result = run_entrypoint(
        *TRAIN_ARGS, timeout=100, NTIL_LAUNCHER="torchrun", NPROC_PER_NODE="2", NTIL_HOME=str(project_home)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = rank_reports(result.stdout)
    assert sorted(reports) == ["0", "1"]
    for report in reports.values():
        assert report["world"] == "2"
        assert report["argv"] == TRAIN_ARGS


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_deepspeed_is_the_default_launcher(project_home):
    result = run_entrypoint(
        "train",
        *TRAIN_ARGS,
        timeout=100,
        NPROC_PER_NODE="2",
        MASTER_PORT=str(free_port()),
        NTIL_HOME=str(project_home),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = rank_reports(result.stdout)
    assert sorted(reports) == ["0", "1"]
    for rank, report in reports.items():
        assert report["world"] == "2"
        # The deepspeed launcher adds --local_rank (launch/train.py accepts it), the rest is passed as is.
        assert report["argv"] == [f"--local_rank={rank}", *TRAIN_ARGS]
