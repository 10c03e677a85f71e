"""benchmarks/gpu_check.sh on this CPU machine: every CUDA step is skipped with its reason, the summary
is written, the exit status is 0; carried wheels are installed (and a broken one fails the run).

What only a GPU can show (the steps themselves passing within their budgets) is not checked here: the
script runs those commands as documented in docs/loss.md and README.md.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile

import pytest

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.sh"
CUDA_STEPS = ("gpu_tests", "loss_table", "head_table", "step_2b")

no_cuda_path = pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="checks the no-CUDA path: this machine has nvidia-smi"
)


def _run(cwd, *args, out=None, bin_dir=None, timeout=60):
    """The script from ``cwd``; OUT is ``out`` as given (default: ``cwd``), ``bin_dir`` first on PATH."""
    path = f"{bin_dir}:/usr/bin:/bin" if bin_dir else "/usr/bin:/bin"
    env = {"PATH": path, "OUT": str(out or cwd), "PYTHON": sys.executable, "HOME": str(cwd)}
    started = time.perf_counter()
    result = subprocess.run(
        ["bash", str(SCRIPT), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,  # a hang guard, not a speed check
    )
    return result, time.perf_counter() - started


def _summary(out) -> dict[str, list[str]]:
    lines = (out / "summary.txt").read_text().splitlines()
    return {
        fields[0]: fields[1:] for fields in (line.split("\t") for line in lines if not line.startswith("#"))
    }


@no_cuda_path
def test_without_cuda_every_gpu_step_is_skipped_with_its_reason(tmp_path):
    result, seconds = _run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    reason = "no CUDA device (nvidia-smi not found)"
    for step in CUDA_STEPS:
        assert f"SKIP {step}: {reason}" in result.stdout
    assert "SKIP setup: no wheel folder given" in result.stdout
    summary = _summary(tmp_path)
    assert list(summary) == ["setup", *CUDA_STEPS]
    for step in CUDA_STEPS:
        status, _, budget, detail = summary[step]
        assert status == "skipped" and detail == reason and int(budget) > 0
    # the per-step budgets add up to the documented total, under 8 minutes with the kill grace
    assert sum(int(fields[2]) for fields in summary.values()) == 425
    print(f"gpu_check.sh without CUDA: {seconds:.2f} s")


def _wheel(folder, name: str, module_source: str, broken: bool = False):
    """A minimal pure-Python wheel, as `pip wheel` writes one (no hashes in RECORD: pip accepts that)."""
    dist = f"{name}-0.1.dist-info"
    path = folder / f"{name}-0.1-py3-none-any.whl"
    files = {
        f"{name}_mod.py": module_source,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if broken:
        del files[f"{dist}/METADATA"]  # pip refuses a wheel without metadata
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return path


@no_cuda_path
def test_carried_wheels_are_installed_and_a_broken_one_fails_the_run(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "ntil_probe", "VALUE = 1\n")
    out = tmp_path / "ok"
    out.mkdir()
    result, _ = _run(out, wheels)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _summary(out)["setup"][0] == "passed"
    assert (out / "installed.txt").read_text().split() == ["ntil_probe-0.1.dist-info"]

    _wheel(wheels, "ntil_broken", "", broken=True)
    out = tmp_path / "broken"
    out.mkdir()
    result, _ = _run(out, wheels)
    assert result.returncode == 1, result.stdout + result.stderr
    assert _summary(out)["setup"][0].startswith("failed (exit")
    assert (out / "setup.log").read_text().strip()  # pip's error is kept

    empty = tmp_path / "empty"
    empty.mkdir()
    result, _ = _run(out, empty)
    assert result.returncode == 1 and f"no *.whl in the wheel folder {empty}" in result.stderr


@no_cuda_path
def test_a_gpu_that_torch_cannot_use_fails_the_check_instead_of_skipping(tmp_path):
    """nvidia-smi lists a GPU but this torch has no CUDA (as a CPU build of torch on a GPU node would):
    every GPU step is marked failed and the exit status is 1, so a check that ran nothing is no pass. OUT
    is given relative to the working directory, as a user types it."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    result, _ = _run(tmp_path, out="relative_out", bin_dir=fake_bin, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    summary = _summary(tmp_path / "relative_out")
    for step in CUDA_STEPS:
        status, _, _, detail = summary[step]
        assert status == "failed" and "nvidia-smi lists a GPU but torch cannot use it" in detail, summary
        assert "torch.cuda.is_available() is False" in detail


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_is_clean():
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
