"""`bash benchmarks/gpu_check.sh --dry-run` on this CPU machine: the preflight runs for real, every later
step's command is built from its decision and checked without CUDA (pytest collects the GPU test files,
the benchmarks resolve their arguments, the 2B step its recipes), and the plan lists the steps in order
with budgets that fit one 540 s device command. docs/loss.md shows the plan as the dry run prints it."""

from __future__ import annotations

import zipfile

from tests.unit.test_gpu_check import GPU_STEPS, run_script, summary

ORDER = ["setup", "preflight", *GPU_STEPS]
DEVICE_COMMAND_S = 540


def _plan(out) -> list[list[str]]:
    return [line.split("\t") for line in (out / "plan.tsv").read_text().splitlines()[1:]]


def test_dry_run_prints_the_plan_in_order_within_the_device_budget_and_checks_every_step(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "einops-0.8.1-py3-none-any.whl", "w") as archive:
        archive.writestr("einops/__init__.py", "")  # only its name matters: a dry run installs nothing
    out = tmp_path / "out"
    result, seconds = run_script(tmp_path, "--dry-run", wheels, out=out)
    assert result.returncode == 0, result.stdout + result.stderr
    plan = _plan(out)
    assert [row[0] for row in plan] == [*ORDER, "total"]
    budgets = [int(row[1]) for row in plan[:-1]]
    assert all(b > 0 for b in budgets) and sum(budgets) == int(plan[-1][1]) <= DEVICE_COMMAND_S
    runs = {row[0]: row[3] for row in plan}
    assert "-v -rA" in runs["gpu_tests_loss"] and "-k 'not compiled_number_stage'" in runs["gpu_tests_loss"]
    assert runs["compile_test"].endswith("-k compiled_number_stage")
    assert (
        "--dtypes bfloat16" in runs["head_table"] and f"--jsonl {out}/head_table.jsonl" in runs["head_table"]
    )
    assert f"--jsonl {out}/loss_table.jsonl" in runs["loss_table"]
    # no Triton launch here (no CUDA): the preflight keeps only the torch rows and torch paths
    assert "--methods cross_entropy,ntil_torch" in runs["loss_table"]
    assert "loss.kernel=torch" in runs["step_2b"]
    would_run = {row[0]: row[2] for row in plan}
    assert would_run["setup"] == f"yes ({wheels})" and would_run["preflight"] == "yes"
    for step in ORDER[2:]:
        assert would_run[step].startswith("no (cuda absent"), (step, would_run[step])
    # every step's check ran and passed; the files are in OUT
    steps = summary(out)
    assert steps["setup"][0] == "dry run" and steps["setup"][4] == "1 wheels found: einops"
    assert steps["preflight"][0] == "passed"
    for step in ORDER[2:]:
        assert steps[f"{step}.dry_run"][:2] == ["passed", "0"], (step, steps)
        assert (out / f"{step}.dry_run.log").read_text().strip()
    assert "1/18 tests collected" in (out / "compile_test.dry_run.log").read_text()
    assert "ZeRO" not in result.stderr and "'zero_stage': 2" in (out / "step_2b.dry_run.log").read_text()
    for name in ("plan.tsv", "summary.tsv", "preflight.json", "preflight.log", "wheels.tsv"):
        assert (out / name).is_file(), name
    assert "plan (" in result.stdout and "total" in result.stdout
    print(f"gpu_check.sh --dry-run: {seconds:.1f} s")


def test_a_bad_option_is_refused_before_anything_runs(tmp_path):
    result, _ = run_script(tmp_path, "--dry", out=tmp_path / "out")
    assert result.returncode == 2 and "usage: bash benchmarks/gpu_check.sh [--dry-run]" in result.stderr
    assert not (tmp_path / "out").exists()
