"""Training jobs on this machine's CPUs, started the way users start them: the real ``deepspeed`` (or
``torchrun``) launcher, N processes on gloo. One place for launch/quickstart.py, launch/compare.py and
the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ntil_ds.dist import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO_ROOT / "launch" / "train.py"

# CPU DeepSpeed, one thread per rank on a small machine, nothing downloaded at run time.
_CPU_DEFAULTS = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


def job_env(**forced: str) -> dict[str, str]:
    """This environment plus the CPU defaults (where not set already), a kept cache for DeepSpeed's
    JIT-compiled ops, the repository on PYTHONPATH, and ``forced`` values on top."""
    env = dict(os.environ)
    for key, value in _CPU_DEFAULTS.items():
        env.setdefault(key, value)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(forced)
    return env


def launcher_command(launcher: str, nproc: int, script: Path | str, args: list[str]) -> list[str]:
    """``deepspeed --num_gpus N --master_port P script args`` or ``torchrun --standalone ...``, from this
    Python's environment; a free port each, so jobs can run side by side."""
    if launcher == "deepspeed":
        deepspeed = Path(sys.executable).with_name("deepspeed")
        return [
            str(deepspeed),
            "--num_gpus",
            str(nproc),
            "--master_port",
            str(free_port()),
            str(script),
            *args,
        ]
    if launcher == "torchrun":
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return [*torchrun, "--nproc_per_node", str(nproc), str(script), *args]
    raise ValueError(f"launcher={launcher!r}: expected 'deepspeed' or 'torchrun'")


def train_args(recipe: Path | str, overrides: list[str]) -> list[str]:
    """launch/train.py's arguments: the recipe and ``key=value`` overrides."""
    return ["--config", str(recipe), *overrides]


def run_job(
    script: Path | str,
    args: list[str],
    *,
    nproc: int,
    launcher: str = "deepspeed",
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """``script`` on ``nproc`` processes through the launcher, to its end, from the repository root. The
    output goes to ``log_path`` (the command on its first line), or into ``.stdout`` without one."""
    command = launcher_command(launcher, nproc, script, args)
    run = {"cwd": REPO_ROOT, "env": env or job_env(), "stderr": subprocess.STDOUT, "timeout": timeout}
    if log_path is None:
        return subprocess.run(command, stdout=subprocess.PIPE, text=True, **run)
    with log_path.open("w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        return subprocess.run(command, stdout=log, **run)


def run_training_job(recipe: Path | str, overrides: list[str], **job) -> subprocess.CompletedProcess:
    """launch/train.py on ``recipe`` with ``key=value`` overrides (``job``: as :func:`run_job`)."""
    return run_job(TRAIN_SCRIPT, train_args(recipe, overrides), **job)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a job's log (tqdm redraws with carriage returns: each line's last state)."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text[-lines:])
