"""ZeRO-3 with images on one rank only: the collator's fake image keeps the ranks in step.

Rank 0 trains on image samples, rank 1 on text-only ones, under real DeepSpeed ZeRO-3 (gloo, torchrun).
With the fake image both ranks train (Qwen2.5-VL, LLaVA, Qwen3-VL, Gemma 3, InternVL, SmolVLM). Without it
rank 1 skips the vision tower, the ranks' parameter all-gathers differ and the job dies within seconds on gloo ("Is there a distributed
collective mismatch?"): run the job with `nofake` to see it (left out of CI for time).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from ntil_ds.tiny import build_tiny_model_folder

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("data_fake_image_job.py")


def _setup(tmp_path, kinds):
    folders = [str(build_tiny_model_folder(kind, tmp_path / kind)) for kind in kinds]
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "clock.png")

    def line(question, answer, image=None):
        parts = [{"type": "image", "image": image}] if image else []
        user = {"role": "user", "content": [*parts, {"type": "text", "text": question}]}
        return json.dumps({"messages": [user, {"role": "assistant", "content": answer}]}) + "\n"

    data = tmp_path / "mixed.jsonl"
    data.write_text(
        line("What time is it?", "10:42", "clock.png")
        + line("And now?", "10:43", "clock.png")
        + line("What is 1+1?", "2")
        + line("What is 20+22?", "42")
    )
    return data, folders


def _torchrun(tmp_path, data, mode, folders, timeout):
    out = tmp_path / mode
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*command, str(JOB), str(data), str(out), mode, *folders],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return result, out


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_fake_image_lets_text_only_ranks_train_under_zero3(tmp_path):
    kinds = ["qwen2_5_vl", "llava", "qwen3_vl", "gemma3", "internvl", "smolvlm"]
    data, folders = _setup(tmp_path, kinds)
    result, out = _torchrun(tmp_path, data, "fake", folders, timeout=360)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for kind in kinds:
        for rank in ranks:
            assert "pixel_values" in rank[kind]["keys"]  # the text-only rank ran the vision tower too
            assert all(math.isfinite(loss) and loss > 0 for loss in rank[kind]["losses"])
