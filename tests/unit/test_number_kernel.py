"""The Triton number stage without a GPU: tests/unit/number_kernel_checks.py in Triton's interpreter, the
launch count of the loss, and the choice of the number stage.

As for the vocabulary kernels (test_loss_kernel.py), TRITON_INTERPRET=1 must be set before the kernels are
defined and must not reach other tests: the checks run in one subprocess and each is reported here as its
own test. ~60 s of CPU time (the interpreter runs every program in Python).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ntil_ds.loss import NTILLoss, kernel_choice, number_terms
from tests.unit import number_kernel_checks

CHECKS_FILE = Path(number_kernel_checks.__file__)
REPO_ROOT = CHECKS_FILE.parents[2]
HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def interpreter_results():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install -c constraints/cpu.txt -e '.[dev]')")
    # PYTHONPATH: the subprocess imports this checkout's ntil_ds, whatever is installed.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, str(CHECKS_FILE)], capture_output=True, text=True, timeout=900, env=env, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


LAUNCH_CHECK = "check_launches_per_forward_and_backward"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(number_kernel_checks.CHECKS) - {LAUNCH_CHECK}))
def test_number_kernel_in_the_interpreter(interpreter_results, name):
    result = interpreter_results[name]
    assert result["status"] == "ok", result["status"]


@pytest.mark.slow
def test_loss_launches_at_most_60_per_forward_and_backward(interpreter_results):
    """Counted on CPU (number_kernel_checks.count_launches): the CUDA-default configuration against the
    limit, at four shapes and modes; the torch number stage's count printed next to it."""
    result = interpreter_results[LAUNCH_CHECK]
    counts = result.get("info") or {}
    print("\nlaunches per NTILLoss forward + backward (aten ops + Triton launches):")
    for name, count in counts.items():
        print(f"  {name:55s} {count['aten']:4d} + {count['triton']} = {count['total']}")
    assert result["status"] == "ok", result["status"]


def test_number_stage_choice(monkeypatch):
    """auto: the kernels for CUDA fp32 columns when Triton imports (the torch stage otherwise); fp64 and
    eager/compile always the torch stage; triton without Triton and a typo are errors, not fallbacks."""
    loss_fn = NTILLoss(list(range(10)))
    assert loss_fn.number_stage == "auto"
    assert loss_fn.number_stage_for(torch.zeros(2, 10)) == "eager"
    cuda = torch.device("cuda", 0)
    # auto on CUDA where Triton works (kernel_choice's probe; its failures are test_kernel_fallback.py's).
    monkeypatch.setattr(kernel_choice, "auto_uses_triton", lambda device, what: True)
    assert number_terms.resolve_number_stage("auto", torch.float32, cuda) == (
        "triton" if HAVE_TRITON else "eager"
    )
    monkeypatch.setattr(number_terms, "number_kernel_module", lambda: None)  # as without Triton
    assert number_terms.resolve_number_stage("auto", torch.float32, cuda) == "eager"
    with pytest.raises(RuntimeError, match="number_stage='triton' but triton does not import"):
        number_terms.resolve_number_stage("triton", torch.float32, cuda)
    monkeypatch.undo()
    fp64 = torch.zeros(2, 10, dtype=torch.float64)
    for stage in ("triton", "auto"):
        assert NTILLoss(list(range(10)), number_stage=stage).number_stage_for(fp64) == "eager"
    assert NTILLoss(list(range(10)), number_stage="compile").number_stage_for(torch.zeros(2, 10)) == "compile"
    typo = "number_stage='compiled': expected one of 'auto', 'eager', 'compile', 'triton'"
    with pytest.raises(ValueError, match=typo):
        NTILLoss(list(range(10)), number_stage="compiled")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_forced_triton_number_stage_on_cpu_is_refused_without_the_interpreter():
    """number_stage="triton" on CPU tensors reaches the kernel wrapper (the argument is passed down, not
    dropped) and stops there with what to do: this process defines the kernels without TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        pytest.skip("TRITON_INTERPRET is set for the whole test run")
    loss_fn = NTILLoss(list(range(10)), number_stage="triton")
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1.*number_stage='auto' or 'eager'"):
        loss_fn(torch.zeros(1, 2, 40), torch.tensor([[1, 2]]))


def test_the_loss_on_cpu_never_imports_triton():
    """On CPU both stages run in torch (auto): importing Triton would cost ~70 MB of RSS and seconds."""
    code = (
        "import sys, torch\n"
        "from ntil_ds.loss import NTILLoss\n"
        "loss_fn = NTILLoss(list(range(10)), decimal_numbers=True, decimal_point_id=11)\n"
        "logits = torch.randn(2, 9, 40, requires_grad=True)\n"
        "loss_fn(logits, torch.randint(0, 40, (2, 9))).loss.backward()\n"
        "print('triton' in sys.modules)\n"
    )
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.stdout.strip() == "False"
