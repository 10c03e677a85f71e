"""`python launch/train.py --config ...` without a launcher (what people type to debug): a job of one
process that just works, as with the HF Trainer; and evaluation makes one forward per batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.distributed.training_runs import (
    REPO_ROOT,
    TINY_RECIPE,
    TRAIN_SCRIPT,
    launch_env,
    tiny_job_overrides,
    tiny_model_and_data,
    train_args,
    train_metrics,
)

pytestmark = [pytest.mark.distributed]

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return tiny_model_and_data(tmp_path_factory.mktemp("single"), "qwen2_vl", n=8, image_size=56)


def no_launcher_env() -> dict[str, str]:
    env = launch_env()
    for name in LAUNCHER_VARIABLES:
        env.pop(name, None)
    return env


def overrides(setup, name: str) -> dict[str, object]:
    root, model_dir, data_file = setup
    extra = {"data.eval_file": data_file, "train.max_steps": 2, "train.eval_every": 2}
    return tiny_job_overrides(root / name, model_dir, data_file, **extra)


def parquet_copy(data_file: Path) -> Path:
    """The JSONL's rows as Parquet in the Hugging Face layout: image bytes in an `images` column."""
    rows = []
    for line in data_file.read_text().splitlines():
        messages, images = [], []
        for m in json.loads(line)["messages"]:
            parts = (
                [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
            )
            for part in parts:
                if part["type"] == "image":
                    images.append({"bytes": (data_file.parent / part["image"]).read_bytes(), "path": None})
            content = [{"type": p["type"], "text": p.get("text")} for p in parts]
            messages.append({"role": m["role"], "content": content})
        rows.append({"messages": messages, "images": images})
    out = data_file.with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


@pytest.mark.timeout(600)
def test_train_py_without_a_launcher_runs_a_one_process_job(tiny_setup):
    over = overrides(tiny_setup, "no_launcher")
    # the training data: the JSONL and its Parquet copy (embedded image bytes), mixed with weights
    parquet = parquet_copy(Path(over["data.train_file"]))
    over["data.train_file"] = ""  # the recipe's: data.mixture replaces it
    over["data.mixture"] = f"[{{file: {over['data.eval_file']}, weight: 1}}, {{file: {parquet}, weight: 3}}]"
    result = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *train_args(TINY_RECIPE, over)],
        cwd=REPO_ROOT, env=no_launcher_env(), capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "mpi4py" not in result.stderr
    assert (
        f"{parquet}: 8 samples kept (0 truncated), 0 skipped (none), gives 12 of each epoch's 16"
        in result.stderr
    )
    assert sorted(train_metrics(over["output_dir"])) == [1, 2]
    assert sorted(train_metrics(over["output_dir"], split="eval")) == [2]


@pytest.mark.timeout(600)
def test_evaluation_makes_one_forward_per_batch(tiny_setup):
    over = overrides(tiny_setup, "eval_probe")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "distributed" / "eval_forward_probe.py"),
         *train_args(TINY_RECIPE, over)],
        cwd=REPO_ROOT, env=no_launcher_env(), capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    # Under ZeRO-3 each forward gathers every parameter: the loss and the predictions share one.
    assert probe["batches"] == 4 and probe["forwards"] == probe["batches"], probe
