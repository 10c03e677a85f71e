"""benchmarks/gpu_check.sh for real on this CPU machine: the preflight runs and every GPU step is skipped
with its reason (exit 0); carried wheels are installed by name, one that fails is named and the rest are
installed (exit 1); a GPU that nvidia-smi lists but torch cannot use fails every GPU step.

What only a GPU can show (the steps passing within their budgets) is not checked here; the dry run
(test_gpu_check_dry_run.py) checks each step's arguments and imports.
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
GPU_STEPS = (
    "gpu_tests_loss",
    "gpu_tests_head",
    "gpu_tests_throughput",
    "loss_table",
    "step_2b",
    "head_table",
    "compile_test",
)
CUDA_ABSENT = "cuda absent (torch.cuda.is_available() is False)"

no_cuda_path = pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="checks the no-CUDA path: this machine has nvidia-smi"
)


def run_script(cwd, *args, out=None, bin_dir=None, timeout=180):
    """The script from ``cwd``; OUT is ``out`` as given (default: ``cwd``), ``bin_dir`` first on PATH."""
    path = f"{bin_dir}:/usr/bin:/bin" if bin_dir else "/usr/bin:/bin"
    # GPU_CHECK_PREFLIGHT_S: the preflight's 20 s are the GPU machine's; 2 shared cores may need more
    env = {"PATH": path, "OUT": str(out or cwd), "PYTHON": sys.executable, "HOME": str(cwd),
           "GPU_CHECK_PREFLIGHT_S": "90"}  # fmt: skip
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


def summary(out) -> dict[str, list[str]]:
    """step -> [status, exit_code, seconds, budget_s, detail]"""
    lines = (out / "summary.tsv").read_text().splitlines()
    return {f[0]: f[1:] for f in (line.split("\t") for line in lines if not line.startswith("#"))}


@no_cuda_path
def test_without_cuda_the_preflight_runs_and_every_gpu_step_is_skipped_with_its_reason(tmp_path):
    result, seconds = run_script(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in GPU_STEPS:
        assert f"SKIP {step}: {CUDA_ABSENT}" in result.stdout
    steps = summary(tmp_path)
    assert list(steps) == ["setup", "preflight", *GPU_STEPS]
    assert steps["setup"][0] == "skipped" and "no wheel folder given" in steps["setup"][4]
    assert steps["preflight"][:2] == ["passed", "0"]
    assert (tmp_path / "preflight.json").is_file() and (tmp_path / "plan.tsv").is_file()
    for step in GPU_STEPS:
        status, code, _, budget, detail = steps[step]
        assert (status, code, detail) == ("skipped", "-", CUDA_ABSENT) and int(budget) > 0
    print(f"gpu_check.sh without CUDA: {seconds:.1f} s")


def _wheel(folder, name: str, broken: bool = False):
    """A minimal pure-Python wheel of distribution ``name`` (module ``<name>_probe``), as pip writes one."""
    dist = f"{name}-0.1.dist-info"
    files = {
        f"{name}_probe.py": "VALUE = 1\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if broken:
        del files[f"{dist}/METADATA"]  # pip refuses a wheel without metadata
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)


@no_cuda_path
def test_wheels_are_installed_by_name_and_a_broken_one_is_named_while_the_rest_install(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "einops")  # names of the manifest: only those are installed
    _wheel(wheels, "hjson")
    _wheel(wheels, "msgpack", broken=True)
    _wheel(wheels, "not_in_the_manifest")
    out = tmp_path / "out"
    result, _ = run_script(tmp_path, wheels, out=out)
    assert result.returncode == 1, result.stdout + result.stderr
    status = dict(line.split(" ", 1) for line in (out / "wheels.tsv").read_text().splitlines())
    assert status["einops"] == status["hjson"] == "installed"
    assert status["msgpack"] == "FAILED (see setup.log)"
    assert status["deepspeed"] == "not carried" and "not_in_the_manifest" not in status
    assert (out / "installed.txt").read_text().split() == ["einops-0.1.dist-info", "hjson-0.1.dist-info"]
    steps = summary(out)
    assert steps["setup"][0] == "failed" and steps["setup"][4].startswith("1 of 3 wheels failed")
    assert steps["preflight"][0] == "passed"  # the run went on

    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out_empty"
    result, _ = run_script(tmp_path, empty, out=out)
    assert result.returncode == 0, result.stdout + result.stderr  # no wheels: the installed packages
    assert summary(out)["setup"][0] == "skipped" and summary(out)["preflight"][0] == "passed"


@no_cuda_path
def test_a_gpu_that_torch_cannot_use_fails_the_check_instead_of_skipping(tmp_path):
    """nvidia-smi lists a GPU but this torch has no CUDA (as a CPU build of torch on a GPU node would):
    every GPU step is marked failed and the exit status is 1, so a check that ran nothing is no pass. OUT
    is given relative to the working directory, as a user types it."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    result, _ = run_script(tmp_path, out="relative_out", bin_dir=fake_bin)
    assert result.returncode == 1, result.stdout + result.stderr
    steps = summary(tmp_path / "relative_out")
    for step in GPU_STEPS:
        status, _, _, _, detail = steps[step]
        assert status == "failed" and "nvidia-smi lists a GPU but torch cannot use it" in detail, steps
        assert CUDA_ABSENT in detail


FAKE_PREFLIGHT = """#!/bin/sh
# python, except that the preflight reports a complete GPU machine (what decide() says for one)
if [ "$1 $2 $3" = "-m benchmarks.preflight --out" ]; then
  exec {python} -c "import json, sys; from tests.unit.test_preflight import _gpu_findings;
from benchmarks.preflight import decide
open(sys.argv[1] + '/preflight.json', 'w').write(json.dumps({{'steps': decide(_gpu_findings())}}))
print('fake preflight: every step runs')" "$4"
fi
exec {python} "$@"
"""


def _run_with_every_step_allowed(out, total_s: int):
    fake = out / "python"
    fake.write_text(FAKE_PREFLIGHT.format(python=sys.executable))
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": str(fake), "HOME": str(out),
           "GPU_CHECK_TOTAL_S": str(total_s), "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    result = subprocess.run(["bash", str(SCRIPT)], cwd=out, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    return result, summary(out)


@no_cuda_path
def test_with_every_step_allowed_each_runs_in_order_and_its_outcome_is_recorded(tmp_path):
    """A preflight that lets every step run (as on a complete GPU machine), on this CPU machine: each step
    runs under its budget; a GPU step that fails here (no CUDA) is recorded with its exit code and the
    next still runs; pytest names every test; the JSONL tables hold this run's rows only."""
    (tmp_path / "loss_table.jsonl").write_text('{"stale": "a row of an earlier run in this OUT"}\n')
    result, steps = _run_with_every_step_allowed(tmp_path, 540)
    assert result.returncode == 1, result.stdout + result.stderr  # the CUDA steps fail on a CPU machine
    assert list(steps) == ["setup", "preflight", *GPU_STEPS]
    for step in ("gpu_tests_loss", "gpu_tests_head", "gpu_tests_throughput", "compile_test"):
        assert steps[step][:2] == ["passed", "0"], steps  # collected, every test skipped without CUDA
    assert steps["loss_table"][:2] == ["failed", "1"]
    assert "no CUDA device visible to torch" in (tmp_path / "loss_table.log").read_text()
    assert (tmp_path / "loss_table.jsonl").read_text() == ""  # none: it failed before its first row
    assert steps["step_2b"][:2] == ["failed", "2"] and steps["head_table"][:2] == ["failed", "2"]
    assert "torch sees no CUDA device" in (tmp_path / "step_2b.log").read_text()
    assert [int(steps[s][3]) for s in GPU_STEPS] == [50, 15, 45, 90, 200, 40, 45]  # the plan's budgets
    log = (tmp_path / "gpu_tests_loss.log").read_text()  # -v: a killed run still shows what finished
    assert "test_loss_cuda.py::test_cuda_matches_float64_cpu[torch-dtype0-1e-05-1e-06] SKIPPED" in log
    assert "compiled_number_stage" not in log
    assert (
        "test_compiled_number_stage_matches_eager_on_cuda SKIPPED"
        in (tmp_path / "compile_test.log").read_text()
    )


@no_cuda_path
def test_budgets_are_clipped_to_what_is_left_and_the_compile_test_needs_its_whole_budget(tmp_path):
    """GPU_CHECK_TOTAL_S=40 (5 s of it the kill grace): the first GPU step's 50 s are clipped to what is
    left; each later step runs within what is left or, with less than 10 s left, is skipped as out of
    time; the optional compile test (45 s) never has its whole budget. Whatever this machine's speed."""
    result, steps = _run_with_every_step_allowed(tmp_path, 40)
    assert list(steps) == ["setup", "preflight", *GPU_STEPS]
    bad = any(fields[0] in ("failed", "timeout") for fields in steps.values())
    assert result.returncode == int(bad), result.stdout + result.stderr  # a skip for time fails nothing
    planned = dict(zip(GPU_STEPS, [50, 15, 45, 90, 200, 40, 45], strict=True))
    assert 10 <= int(steps["gpu_tests_loss"][3]) <= 35 < planned["gpu_tests_loss"]  # clipped, and ran
    for step in GPU_STEPS[1:-1]:
        status, code, seconds, budget, detail = steps[step]
        if status == "skipped":
            assert (code, seconds, detail) == ("-", "0", "no time left of the 40 s"), step
        else:
            assert 10 <= int(budget) <= min(35, planned[step]) and code != "-", step
    status, _, _, _, detail = steps["compile_test"]
    assert status == "skipped" and detail.startswith("optional, and only") and detail.endswith("of the 40 s")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_is_clean():
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
