"""Launch real training jobs (torchrun / deepspeed launcher, 2 CPU processes) and read what they wrote."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
from PIL import Image, ImageDraw

from ntil_ds import jobs
from ntil_ds.jobs import REPO_ROOT, TRAIN_SCRIPT, job_env, launcher_command, run_job

TINY_RECIPE = REPO_ROOT / "configs" / "train" / "tiny_qwen2vl_clock.yaml"
LAUNCH_TIMEOUT_S = 540  # generous: an outer guard against hangs, not a speed check
T = TypeVar("T")


def launch_env(**extra: str) -> dict[str, str]:
    """The jobs' environment, with the CPU settings forced (a developer's OMP_NUM_THREADS would change
    the float order of the runs the tests compare)."""
    return job_env(
        OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **extra
    )


def train_args(recipe: Path, overrides: dict[str, object]) -> list[str]:
    return jobs.train_args(recipe, [f"{k}={v}" for k, v in overrides.items()])


def run_training(
    overrides: dict[str, object],
    *,
    nproc: int = 2,
    launcher: str = "torchrun",
    script: Path = TRAIN_SCRIPT,
    recipe: Path = TINY_RECIPE,
    timeout: float = LAUNCH_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run a job to its end; the output (stdout+stderr) is in .stdout."""
    return run_job(
        script,
        train_args(recipe, overrides),
        nproc=nproc,
        launcher=launcher,
        env=env or launch_env(),
        timeout=timeout,
    )


def run_together(calls: dict[str, Callable[[], T]], at_once: int = 4) -> dict[str, T]:
    """Each call (a job run to its end) in a thread of its own, ``at_once`` of them running together: a
    2-rank job keeps the 2 cores busy about three quarters of its time (start-up, launcher, gloo waits),
    and the other jobs take the rest. Their results by name; a call's exception is raised here."""
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
    return {name: future.result() for name, future in futures.items()}


def allreduce_workspaces_left(port: str) -> list[Path]:
    """DeepSpeed's CPU allreduce workspaces (one per rank) still in /dev/shm of the job whose launcher used
    ``port`` as its master port: none once the job has ended, if they were unlinked."""
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def start_training(
    nproc: int, script: Path, overrides: dict[str, object], env: dict[str, str], recipe: Path = TINY_RECIPE
) -> subprocess.Popen:
    """A job started and left running (several at once overlap their start-up on 2 cores); see
    :func:`finish_training`."""
    return subprocess.Popen(
        launcher_command("torchrun", nproc, script, train_args(recipe, overrides)),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish_training(job: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, str]:
    """A started job's exit code and output (stdout+stderr), once it ended; killed past ``timeout``."""
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        output, _ = job.communicate()
        pytest.fail(f"training job did not finish in {timeout} s:\n{output[-4000:]}")
    return job.returncode, output


def kill_after_checkpoint(
    overrides: dict[str, object],
    step: int,
    *,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    timeout: float = 500,
) -> None:
    """Start a 2-process torchrun job and kill it, launcher and workers, as a node failure would, as
    soon as its step-``step`` checkpoint is COMPLETE. Asserts the job was still running then."""
    command = launcher_command("torchrun", 2, TRAIN_SCRIPT, train_args(TINY_RECIPE, overrides))
    marker = Path(str(overrides["output_dir"])) / "checkpoints" / f"step_{step:08d}" / "COMPLETE"
    with open(log_path or os.devnull, "w") as log_file:
        job = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env or launch_env(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout
            while not marker.exists() and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert marker.exists(), f"the job never completed its step-{step} checkpoint"
            assert job.poll() is None, "the job finished before it could be killed: nothing to resume"
        finally:
            # torchrun starts its workers in sessions of their own: they are found as descendants,
            # not by process group.
            psutil.wait_procs(kill_process_tree(job.pid), timeout=60)
            job.wait(timeout=60)


def kill_process_tree(pid: int) -> list[psutil.Process]:
    """SIGKILL the process ``pid`` and all its descendants; returns them for ``psutil.wait_procs``.
    A descendant that ends between the listing and its kill (a compiler, a tokenizer worker) is not
    an error: the kill's purpose is met."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return tree


def tiny_job_overrides(out: Path, model_dir: Path, data_file: Path, **extra: object) -> dict[str, object]:
    """A short fp32 job on a tiny model folder: fixed sample order, no eval, export or tracking, 4 steps
    of 4 samples (2 ranks x micro-batch 2). Tests change what they check through ``extra``."""
    return {
        "output_dir": out,
        "model.name_or_path": model_dir,
        "model.init": "random",
        "model.dtype": "float32",
        "data.train_file": data_file,
        "data.eval_file": "",
        "data.max_seq_len": 128,
        "data.shuffle": "false",
        "optim.name": "adamw_torch",
        "optim.warmup_steps": 0,
        "train.max_steps": 4,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,
        "train.export_at_end": "false",
        "tracking.enabled": "false",
        **extra,
    }


def tiny_model_and_data(root: Path, kind: str, n: int, image_size: int) -> tuple[Path, Path, Path]:
    """``(root, model folder, train JSONL)``: a tiny random ``kind`` model folder and mixed text/image
    arithmetic data (see :func:`write_mixed_arithmetic_data`) under ``root``."""
    from ntil_ds.tiny import build_tiny_model_folder

    model_dir = build_tiny_model_folder(kind, root / "model")
    return root, model_dir, write_mixed_arithmetic_data(root / "data", n=n, image_size=image_size)


def train_metrics(output_dir: Path, split: str = "train") -> dict[int, dict]:
    """step -> record (the last record of a step wins: a resumed run repeats steps)."""
    records: dict[int, dict] = {}
    for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == split:
            records[record["step"]] = record
    return records


def write_mixed_arithmetic_data(out_dir: Path, n: int, image_size: int, seed: int = 0) -> Path:
    """Arithmetic Q/A with some questions shown as an image: blocks of 4 lines cycle through
    [image, text, image, text] / all text / all image, so with 2 ranks, micro-batch 2 and no shuffling
    the ranks see image+text, text-only (fake image) and image-only micro-batches, and steps where
    one rank has images and the other none."""
    rng = random.Random(seed)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        block = (i // 4) % 3
        with_image = (block == 0 and i % 2 == 0) or block == 2
        question = f"What is {a} + {b}?"
        if with_image:
            image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
            ImageDraw.Draw(image).text((2, image_size // 3), f"{a}+{b}", fill=(0, 0, 0))
            path = f"images/{i}.png"
            image.save(out_dir / path)
            content: object = [{"type": "image", "image": path}, {"type": "text", "text": question}]
        else:
            content = question
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": content},
                        {"role": "assistant", "content": str(a + b)},
                    ]
                }
            )
        )
    path = out_dir / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
