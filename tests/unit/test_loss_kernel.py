"""The Triton loss kernels without a GPU: tests/unit/loss_kernel_checks.py in Triton's interpreter.

TRITON_INTERPRET=1 has to be in the environment before the kernels are defined and must not reach the
other tests, so the checks run in one subprocess (one import of torch and triton for all of them) and
each check is reported here as its own test. ~30 s of CPU time.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ntil_ds.loss import vocab_stats
from tests.unit import loss_kernel_checks

CHECKS_FILE = Path(loss_kernel_checks.__file__)
HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def interpreter_results():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install -c constraints/cpu.txt -e '.[dev]')")
    # PYTHONPATH: the subprocess imports this checkout's ntil_ds, whatever is installed.
    path = os.pathsep.join(p for p in (str(CHECKS_FILE.parents[2]), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, str(CHECKS_FILE)], capture_output=True, text=True, timeout=900, env=env, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(loss_kernel_checks.CHECKS))
def test_kernel_in_the_interpreter(interpreter_results, name):
    result = interpreter_results[name]
    assert result == "ok", result


def test_kernel_choice():
    """auto: CUDA logits in fp32/bf16/fp16 only (CPU never imports triton for the loss); fp64 and
    kernel="torch" always take the torch path; a typo is an error, not a silent fallback."""
    from ntil_ds.loss import NTILLoss

    cpu = torch.zeros(2, 3)
    assert vocab_stats.kernel_wanted(cpu) is None
    for kernel in ("torch", "triton"):
        assert vocab_stats.kernel_wanted(cpu.double(), kernel) is None
    assert vocab_stats.kernel_wanted(cpu, "torch") is None
    typo = r"kernel='trition': expected one of 'auto', 'torch', 'triton'"
    with pytest.raises(ValueError, match=typo):
        vocab_stats.kernel_wanted(cpu, "trition")
    with pytest.raises(ValueError, match=typo):  # at construction, before any step
        NTILLoss(list(range(10)), kernel="trition")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernel_argument_reaches_the_kernels_and_cpu_is_refused_without_the_interpreter():
    """NTILLoss(kernel="triton") on CPU tensors must reach the kernel wrappers (so the argument is passed
    down, not dropped) and stop there: this process defines the kernels without TRITON_INTERPRET=1."""
    from ntil_ds.loss import NTILLoss

    if os.environ.get("TRITON_INTERPRET", "0") != "0":  # not the kernel's own check: that is under test
        pytest.skip("TRITON_INTERPRET is set for the whole test run")
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1.*kernel='auto' or 'torch'"):
        NTILLoss(list(range(10)), kernel="triton")(torch.zeros(1, 2, 40), torch.tensor([[1, 2]]))


def test_torch_path_tiles_stay_cpu_sized_on_cpu():
    """On CPU the torch path's row tiles cover every row once, in order, and hold at most 2**20 logits
    (one row at least, however wide): CUDA's larger tiles never leak onto the CPU."""
    cpu = torch.device("cpu")
    for rows, width in ((5000, 1003), (3, 1 << 21), (1, 7)):
        tiles = vocab_stats._row_tiles(rows, width, cpu)
        assert [start for start, _ in tiles] == [0, *(end for _, end in tiles[:-1])] and tiles[-1][1] == rows
        assert all((end - start) * width <= max(width, 1 << 20) for start, end in tiles)
    assert len(vocab_stats._row_tiles(5000, 1003, cpu)) == -(-5000 // ((1 << 20) // 1003))


def test_recipe_keys_reach_the_loss(tmp_path):
    """loss.kernel / loss.number_stage go through build_loss, for loss.name=ntil and for ntl (whose inner
    NTILLoss computes the cross-entropy); a wrong value stops at config load."""
    from transformers import AutoTokenizer

    from ntil_ds.config import ConfigError, load_config
    from ntil_ds.loss.build import build_loss
    from ntil_ds.tiny import build_tiny_model_folder

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model_folder("qwen2", tmp_path / "tiny"))
    base = [f"model.name_or_path={tmp_path}", "data.train_file=x"]
    default = build_loss(load_config(None, base), tokenizer)
    assert (default.kernel, default.number_stage) == ("auto", "auto")
    for name in ("ntil", "ntl"):
        keys = [f"loss.name={name}", "loss.kernel=torch", "loss.number_stage=compile"]
        loss_fn = build_loss(load_config(None, base + keys), tokenizer)
        ntil = loss_fn.ntil if name == "ntl" else loss_fn
        assert (ntil.kernel, ntil.number_stage) == ("torch", "compile"), name
    with pytest.raises(ConfigError, match="loss.kernel='cuda' is not one of 'auto', 'torch', 'triton'"):
        load_config(None, [*base, "loss.kernel=cuda"])
