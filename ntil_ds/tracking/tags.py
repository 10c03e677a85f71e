"""Run tags that let a user tell runs apart: code version, job, cluster shape, library versions, model.

Gathered without importing torch, deepspeed or transformers (``importlib.metadata`` reads the
installed versions), so building the tags costs milliseconds.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
from collections.abc import Mapping
from pathlib import Path

import ntil_ds
from ntil_ds.dist import DistInfo

_REPO_ROOT = Path(__file__).resolve().parents[2]
_VERSIONED_PACKAGES = ("torch", "deepspeed", "transformers", "accelerate", "mlflow")


def default_tags(
    dist: DistInfo, model_id: str, environ: Mapping[str, str], repo_dir: Path = _REPO_ROOT
) -> dict[str, str]:
    """``ntil_ds.*`` tags for the run. ``environ`` is the job's environment (``os.environ`` from the
    entry point): SLURM's variables say which job and how many nodes."""
    tags = {
        "ntil_ds.model": model_id,
        "ntil_ds.world_size": str(dist.world_size),
        "ntil_ds.tp_size": str(dist.tp_size),
        "ntil_ds.dp_size": str(dist.dp_size),
        # Without SLURM the job is one node (the deepspeed launcher / torchrun on this machine).
        "ntil_ds.num_nodes": environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1",
        "ntil_ds.slurm_job_id": environ.get("SLURM_JOB_ID", ""),
        "ntil_ds.version.ntil_ds": ntil_ds.__version__,
        **_git_tags(repo_dir),
    }
    for package in _VERSIONED_PACKAGES:
        try:
            tags[f"ntil_ds.version.{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            tags[f"ntil_ds.version.{package}"] = "not installed"
    return {key: value for key, value in tags.items() if value != ""}


def _git_tags(repo_dir: Path) -> dict[str, str]:
    """Commit and dirty flag of the code that runs; empty when it is not a git checkout (a container)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo_dir), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    # mlflow.source.git.commit is the tag MLflow's UI shows as the run's source version.
    return {"mlflow.source.git.commit": commit, "ntil_ds.git_commit": commit, "ntil_ds.git_dirty": str(dirty)}
