"""kernel="auto" and number_stage="auto" fall back to the torch path, with one warning naming the cause,
when Triton cannot compile or launch (ntil_ds/loss/kernel_choice.py); "triton" still raises.

Each scenario of tests/unit/kernel_fallback_checks.py runs in its own subprocess: the probe's result is
cached per process, and TRITON_INTERPRET must be set before the kernels are defined. ~15 s of CPU.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ntil_ds.loss import kernel_choice, number_terms
from tests.unit import kernel_fallback_checks

CHECKS_FILE = Path(kernel_fallback_checks.__file__)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def scenario(name: str, tmp_path: Path, **env_changes) -> dict:
    path = os.pathsep.join(p for p in (str(CHECKS_FILE.parents[2]), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # A fresh Triton cache, so that nothing built by another test hides a failing build.
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path, TRITON_CACHE_DIR=str(tmp_path / "triton"), **env_changes)
    done = subprocess.run(
        [sys.executable, str(CHECKS_FILE), name],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_fell_back(result: dict, cause: str) -> None:
    assert len(result["warnings"]) == 1, result["warnings"]  # once, for the vocabulary and number stages both
    assert "Triton cannot run on cpu" in result["warnings"][0] and cause in result["warnings"][0]
    assert result["kernel_calls"] == {"vocab": 0, "number": 0}
    assert result["auto_equals_torch"]  # the torch path itself: bit for bit


def test_auto_falls_back_when_triton_cannot_launch(tmp_path):
    """No driver for the device (and no C compiler, CC pointing nowhere): auto warns once and computes the
    torch path's numbers; kernel="triton" and number_stage="triton" raise the kernels' own errors."""
    result = scenario("launch", tmp_path, CC=str(tmp_path / "no-such-cc"))
    # The cause as Triton words it: "0 active drivers" on a machine without a GPU, a CPU-pointer error on one
    # with a GPU (the CPU is never a device Triton launches on outside the interpreter).
    assert_fell_back(result, "Error: ")
    assert result["triton_error"] and "TRITON_INTERPRET=1" in result["triton_error"], result["triton_error"]
    assert result["number_triton_error"] and "TRITON_INTERPRET=1" in result["number_triton_error"]


def test_auto_falls_back_when_the_probe_kernel_does_not_compile(tmp_path):
    result = scenario("compile", tmp_path, TRITON_INTERPRET="1")
    assert_fell_back(result, "arange's arguments must be of type tl.constexpr")


def test_auto_takes_the_kernels_when_the_probe_passes(tmp_path):
    """The other side of the gate: where the probe's kernel runs (the interpreter), auto runs the kernels."""
    result = scenario("works", tmp_path, TRITON_INTERPRET="1")
    assert result["warnings"] == []
    assert result["kernel_calls"]["vocab"] >= 2 and result["kernel_calls"]["number"] == 2, result[
        "kernel_calls"
    ]
    assert result["auto_close_to_torch"]
    assert result["triton_error"] is None and result["number_triton_error"] is None


def test_probe_runs_once_per_device_and_names_the_cause(monkeypatch):
    """In this process (no GPU): the CUDA probe fails for real, once; number_stage="auto" on CUDA columns is
    then the torch stage, with one warning; CPU columns never probe."""
    monkeypatch.setattr(kernel_choice, "_failures", {})
    monkeypatch.setattr(kernel_choice, "_warned", set())
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CUDA probe would pass")
    cuda = torch.device("cuda", 0)
    assert number_terms.resolve_number_stage("auto", torch.float32, torch.device("cpu")) == "eager"
    assert kernel_choice._failures == {}
    with pytest.warns(RuntimeWarning, match=r"Triton cannot run on cuda:0 \(\w+Error: "):
        assert number_terms.resolve_number_stage("auto", torch.float32, cuda) == "eager"
    assert list(kernel_choice._failures) == ["cuda:0"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        assert number_terms.resolve_number_stage("auto", torch.float32, cuda) == "eager"
