"""benchmarks/preflight.py on this CPU machine: it runs, reports cuda absent and every GPU step skipped, never
imports transformers itself, and survives packages that break, print or hang on import; under Triton's
interpreter its Triton launch and the Triton-vs-torch NTILLoss check run for real. decide() (which later
gpu_check.sh steps run) is checked on findings as a GPU machine would give them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from benchmarks.preflight import KERNEL_METHODS, STEPS, TORCH_METHODS, decide, manifest_entries
from tests.conftest import REPO_ROOT

VERSIONS = ("python", "torch", "cuda", "triton", "deepspeed", "transformers", "liger", "flash_attn")


def _preflight(out: Path, extra_path: Path | None = None, **env: str):
    path = os.pathsep.join(p for p in (str(extra_path or ""), str(REPO_ROOT)) if p)
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment.update(PYTHONPATH=path, **env)
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.preflight", "--out", str(out)],
        cwd=REPO_ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = process.communicate(timeout=120)  # a hang guard, not the budget
    assert process.returncode == 0, output
    return (
        json.loads((out / "preflight.json").read_text()),
        output,
        process.pid,
        time.perf_counter() - started,
    )


def _fake_packages(folder: Path, marker: Path) -> Path:
    """A deepspeed that raises on import, a liger_kernel that hangs, a transformers that prints to stdout
    and records the pid of every process that imports it."""
    folder.mkdir()
    (folder / "deepspeed").mkdir()
    (folder / "deepspeed" / "__init__.py").write_text("raise RuntimeError('broken build for this torch')\n")
    (folder / "liger_kernel").mkdir()
    (folder / "liger_kernel" / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    (folder / "transformers").mkdir()
    (folder / "transformers" / "__init__.py").write_text(
        f"import os\nprint('a noisy import')\nopen({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "__version__ = '5.17.0'\n"
    )
    return folder


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the no-CUDA path")
def test_on_cpu_it_reports_cuda_absent_and_survives_broken_imports(tmp_path):
    marker = tmp_path / "transformers_pids"
    fakes = _fake_packages(tmp_path / "fakes", marker)
    found, output, pid, seconds = _preflight(tmp_path, fakes, PREFLIGHT_IMPORT_TIMEOUT_S="6")
    versions = found["versions"]
    assert set(VERSIONS) <= set(versions)
    assert versions["deepspeed"] == "absent (RuntimeError: broken build for this torch)"
    assert versions["liger"] == "absent (import did not finish in 6 s)"
    assert versions["transformers"] == "5.17.0"  # its print did not spoil the probe's line
    assert versions["flash_attn"].startswith("absent (ModuleNotFoundError")
    # transformers was imported, but only by the isolated probe, never by the preflight process
    pids = marker.read_text().split()
    assert len(pids) == 1 and int(pids[0]) != pid and found["transformers_imported_here"] is False
    assert found["cuda"] == {"available": False, "why": "torch.cuda.is_available() is False"}
    has_compiler = (shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")) is not None
    assert found["compiler"]["present"] is has_compiler
    headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    assert found["python"]["python_h"] is headers
    for key in ("triton_launch", "ntil_triton_vs_torch", "launches"):
        assert found[key] == {"ok": False, "skipped": "cuda absent", "error": "cuda absent"}
    assert list(found["steps"]) == list(STEPS)
    for step, decision in found["steps"].items():
        assert decision["run"] is False and decision["reason"].startswith("cuda absent"), step
    # this venv has every carried module, less the two fakes: the hanging one does not spoil the rest
    missing = found["manifest"]["missing_modules"]
    assert missing == {
        "deepspeed": "RuntimeError: broken build for this torch",
        "liger_kernel": "import did not finish in 6 s",
    }
    assert "step loss_table: skip (cuda absent" in output
    print(f"preflight on CPU: {seconds:.1f} s (6 s of it the hanging import)")


def test_under_the_triton_interpreter_the_kernel_checks_run(tmp_path):
    found, _, _, seconds = _preflight(tmp_path, TRITON_INTERPRET="1")
    assert found["triton_launch"]["ok"] is True
    check = found["ntil_triton_vs_torch"]
    assert check["ok"] is True and check["shape"] == [2, 64, 1003]
    assert 0 <= check["max_abs_diff_parts"] <= check["tolerance"]
    assert 0 <= check["max_abs_diff_grad"] <= check["tolerance"]
    assert found["launches"]["skipped"].startswith("cuda absent")
    print(f"preflight under TRITON_INTERPRET=1: {seconds:.1f} s")


def _gpu_findings(**changes) -> dict:
    found = {
        "cuda": {"available": True},
        "versions": {"transformers": "5.24.0", "deepspeed": "0.19.8"},
        "triton_launch": {"ok": True},
        "compiler": {"present": True},
        "manifest": {"missing_modules": {}},
    }
    found.update(changes)
    return found


def test_decide_runs_everything_on_a_complete_gpu_machine():
    steps = decide(_gpu_findings())
    assert [s for s, d in steps.items() if not d["run"]] == []
    assert steps["loss_table"]["methods"] == KERNEL_METHODS and steps["step_2b"]["overrides"] == ""


def test_decide_without_a_triton_launch_keeps_the_torch_rows_and_the_2b_step_on_torch_paths():
    steps = decide(
        _gpu_findings(triton_launch={"ok": False, "error": "RuntimeError: Failed to find C compiler"})
    )
    assert steps["loss_table"]["run"] and steps["loss_table"]["methods"] == TORCH_METHODS
    assert not steps["head_table"]["run"] and "Failed to find C compiler" in steps["head_table"]["reason"]
    assert not steps["compile_test"]["run"]
    assert steps["step_2b"]["run"] and "loss.kernel=torch" in steps["step_2b"]["overrides"]
    assert steps["gpu_tests_loss"]["run"]  # the torch-path tests still run; the Triton ones fail by name


def test_decide_without_transformers_skips_the_2b_step_but_not_the_loss_table():
    versions = {"transformers": "absent (ImportError: tokenizers>=0.23 is required)", "deepspeed": "0.19.8"}
    steps = decide(_gpu_findings(versions=versions))
    assert not steps["step_2b"]["run"] and "tokenizers>=0.23" in steps["step_2b"]["reason"]
    assert not steps["gpu_tests_throughput"]["run"]
    assert steps["loss_table"]["run"] and steps["head_table"]["run"] and steps["gpu_tests_loss"]["run"]
    old = decide(_gpu_findings(versions={"transformers": "5.17.0", "deepspeed": "0.19.8"}))
    assert old["step_2b"]["run"] and "older than the pin 5.24" in old["step_2b"]["note"]


def test_decide_with_a_missing_module_skips_only_the_steps_that_import_it():
    steps = decide(_gpu_findings(manifest={"missing_modules": {"psutil": "ModuleNotFoundError"}}))
    assert not steps["gpu_tests_throughput"]["run"] and "psutil" in steps["gpu_tests_throughput"]["reason"]
    assert steps["gpu_tests_loss"]["run"] and steps["loss_table"]["run"] and steps["step_2b"]["run"]
    steps = decide(_gpu_findings(manifest={"missing_modules": {"pytest": "ModuleNotFoundError"}}))
    assert not steps["gpu_tests_loss"]["run"] and not steps["compile_test"]["run"]
    assert steps["loss_table"]["run"]


def test_the_manifest_parses():
    entries = manifest_entries()
    assert ("pillow", "PIL") in entries and ("py-cpuinfo", "cpuinfo") in entries
    assert len({d for d, _ in entries}) == len(entries)


def test_step_decision_is_one_tab_separated_line_with_no_empty_field(tmp_path):
    """What gpu_check.sh reads with IFS=tab (where empty fields would collapse): '-' stands for none."""
    from benchmarks.preflight import step_decision

    path = tmp_path / "preflight.json"
    path.write_text(json.dumps({"steps": decide(_gpu_findings(versions={"transformers": "absent (x)"}))}))
    assert step_decision(path, "loss_table") == f"run\t-\t{KERNEL_METHODS}"
    assert step_decision(path, "step_2b") == "skip\ttransformers absent (x)\t-"
    assert step_decision(path, "gpu_tests_loss") == "run\t-\t-"
    missing = step_decision(tmp_path / "none.json", "head_table")
    assert missing.startswith("run\tno preflight decision (FileNotFoundError") and missing.endswith("\t-")
    with pytest.raises(SystemExit, match="unknown step"):
        step_decision(path, "head")
