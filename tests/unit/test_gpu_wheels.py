"""benchmarks/gpu_wheels.txt, the wheels gpu_check.sh carries to a GPU machine that has only torch, triton
and transformers, against what the GPU steps import.

What they import: the module-level imports (including those under a module-level if/try) of tests/gpu,
the benchmarks the steps run and every project module those load, followed through the project's own
modules; plus the lazy imports the GPU steps take inside functions (named below, each with its reason).
Those modules' distributions (this venv's packages_distributions), with their own requirements (the
installed metadata, extras and markers evaluated here), less what torch, triton and transformers
require, must be in the manifest, and nothing else but deepspeed's and pytest's requirements: a missing wheel is a collection error or a skipped step on the
GPU, an extra one is weight the 64 MiB carry does not have.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

from benchmarks.preflight import manifest_entries
from tests.conftest import REPO_ROOT

LOCAL = ("ntil_ds", "benchmarks", "tests")
GPU_ROOTS = [
    *(
        f"benchmarks.{name}"
        for name in (
            "preflight",
            "loss_speed",
            "loss_speed_cuda",
            "loss_cases",
            "head_speed",
            "train_step",
            "loss_pair_job",
            "hf_trainer_job",
            "model_2b",
        )
    ),
    "tests.conftest",
    "tests.gpu.test_loss_cuda",
    "tests.gpu.test_labelled_head_cuda",
    "tests.gpu.test_throughput_cuda",
    "ntil_ds.trainer",  # loss_pair_job.py's Trainer, imported inside main()
    "ntil_ds.ds_config",
    "ntil_ds.data",
    "ntil_ds.model",
    "ntil_ds.data.synthetic",
    "ntil_ds.tiny",
]
LAZY = {
    "accelerate": "transformers' Trainer with a DeepSpeed config (hf_trainer_job.py)",
    "liger_kernel": "model.kernels=liger in the 2B job; the loss and head tables' Liger rows",
    "triton": "ntil_ds.loss's kernels (vocab_stats.kernel_module)",
    "pytest_timeout": "pyproject's [tool.pytest.ini_options] timeout",
}
PREINSTALLED = ("torch", "triton", "transformers")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _file(module: str):
    path = REPO_ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_level_imports(path, module: str) -> set[str]:
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                parts = package[: len(package) - node.level + 1] if node.level else []
                base = ".".join([*parts, *([node.module] if node.module else [])])
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text()).body)
    return found


def third_party_imports(roots) -> set[str]:
    seen, third, todo = set(), set(), list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        top = module.split(".")[0]
        if top in LOCAL:
            path = _file(module)
            if path is not None:
                parts = module.split(".")
                todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages run first
                todo += module_level_imports(path, module)
        elif top not in sys.stdlib_module_names and top != "__future__":
            third.add(top)
    return third


def requirement_closure(names) -> set[str]:
    seen, todo = set(), [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in md.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonical(requirement.name))
    return seen


def test_the_static_analysis_sees_the_imports_that_matter():
    """Guards the analysis itself: psutil and PIL reach tests/gpu only through tests/distributed and
    ntil_ds.data (the collection errors of the review), deepspeed through ntil_ds.engine."""
    assert {"PIL", "psutil"} <= third_party_imports(["tests.gpu.test_throughput_cuda"])
    assert "deepspeed" in third_party_imports(["ntil_ds.trainer"])
    assert third_party_imports(["benchmarks.loss_speed"]) == {"torch"}  # the loss table needs only torch


def test_the_manifest_is_what_the_gpu_steps_import_less_what_the_gpu_machine_has():
    pytest_options = (REPO_ROOT / "pyproject.toml").read_text().split("[tool.pytest.ini_options]")[1]
    assert re.search(r"^timeout = ", pytest_options.split("\n[")[0], re.M), "pytest-timeout is not used"
    by_module = md.packages_distributions()
    modules = third_party_imports(GPU_ROOTS) | set(LAZY)
    distributions = {canonical(d) for m in modules for d in by_module[m]}
    wanted = requirement_closure(distributions) - requirement_closure(PREINSTALLED)
    # deepspeed and pytest: their own requirements may be carried even where this venv's transformers brings
    # them (pydantic, pygments): the GPU machine's older transformers need not.
    allowed = wanted | (
        requirement_closure(["deepspeed", "pytest"]) - requirement_closure(["torch", "triton"])
    )
    listed = {canonical(d) for d, _ in manifest_entries()}
    assert sorted(wanted - listed) == [], "the GPU steps import these: add them to benchmarks/gpu_wheels.txt"
    assert sorted(listed - allowed) == [], "nothing on the GPU path imports these: drop them"
    for distribution, module in manifest_entries():
        assert canonical(distribution) in {canonical(d) for d in by_module.get(module, [])}, (
            distribution,
            module,
        )
