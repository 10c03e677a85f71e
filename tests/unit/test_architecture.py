"""The house rules of docs/design/architecture.md, enforced by parsing the code's imports.

- No import cycle anywhere in ntil_ds/, launch/, benchmarks/: computed from every import, function-local
  ones included (a local import does not break a cycle, it hides it).
- Size budgets: no library file over 450 lines; trainer.py at most 400 and its train_step at most 60;
  the entry points in launch/ are thin (at most 200 lines each).
- Boundaries: only engine.py imports deepspeed; only tracking/mlflow_*.py import mlflow; ds_config.py
  reads DeepSpeed JSON without deepspeed; tracking/base.py imports nothing else of tracking/; loss/,
  data/, model/ and tiny/ never import each other (they meet as arguments in the trainer); the
  foundation (typed_config, config, dist, constants) builds on nothing else; no grab-bag modules.
- Nothing is loaded by file path: launch/ holds command-line entry points only, never imported by the
  library, and no file anywhere loads a module from a path (importlib's spec_from_file_location).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ntil_ds"
CODE_FOLDERS = ("ntil_ds", "launch", "benchmarks")
LEAF_PACKAGES = ("loss", "data", "model", "tiny")
FOUNDATION = (
    "typed_config",
    "config_lora",
    "config_parallel",
    "config",
    "dist",
    "constants",
)  # each on those before it only
LIBRARY_FILE_LINES = 450
TRAINER_LINES = 400
TRAIN_STEP_LINES = 60
ENTRY_POINT_LINES = 200


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def code_files(*folders: str) -> list[Path]:
    files = sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))
    assert len(files) > 5, f"no code found under {folders}"
    return files


def imported_modules(path: Path) -> set[str]:
    """Every module name an import in ``path`` mentions, relative imports resolved; for ``from a import
    b`` both ``a`` and ``a.b`` (b may be a module)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports. A package's __init__ importing its own submodules, and
    a submodule importing its package, are not edges (Python's package import order)."""
    modules = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target in imported_modules(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if not target or target == name:
                continue
            if path.name == "__init__.py" and target.startswith(name + "."):
                continue
            if name.startswith(target + "."):
                continue
            graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def top(name: str) -> str:
    return name.split(".")[0]


def library_files() -> list[Path]:
    return code_files("ntil_ds")


def users_of(package: str) -> list[str]:
    return sorted(
        str(p.relative_to(PACKAGE))
        for p in library_files()
        if any(top(n) == package for n in imported_modules(p))
    )


# ----------------------------------------------------------------------------------------------------


def test_cycle_finder_finds_a_cycle():
    """The check below can fail: a two-module and a three-module cycle are found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph(code_files(*CODE_FOLDERS)))
    assert not found, f"import cycles (break them by moving the shared names to a module below both): {found}"


def test_size_budgets():
    too_big = {
        str(p.relative_to(ROOT)): n
        for p in library_files()
        if (n := len(p.read_text().splitlines())) > LIBRARY_FILE_LINES
    }
    assert not too_big, f"library files over {LIBRARY_FILE_LINES} lines (split them by job): {too_big}"
    trainer = PACKAGE / "trainer.py"
    assert len(trainer.read_text().splitlines()) <= TRAINER_LINES
    step = next(
        node
        for node in ast.walk(ast.parse(trainer.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "train_step"
    )
    body_start = step.body[1].lineno if ast.get_docstring(step) else step.body[0].lineno  # after the contract
    assert step.end_lineno - body_start + 1 <= TRAIN_STEP_LINES, (
        "train_step grew: move the side job to its owner"
    )
    entry_points = {
        p.name: n for p in code_files("launch") if (n := len(p.read_text().splitlines())) > ENTRY_POINT_LINES
    }
    assert not entry_points, (
        f"launch/ files are thin CLIs over ntil_ds/ (over {ENTRY_POINT_LINES} lines): {entry_points}"
    )


def test_only_engine_imports_deepspeed():
    assert users_of("deepspeed") in ([], ["engine.py"]), users_of("deepspeed")
    assert "ds_config.py" not in users_of("deepspeed")


def test_only_mlflow_tracking_modules_import_mlflow():
    users = users_of("mlflow")
    assert users, "no module imports mlflow: the rule below checks nothing"
    for name in users:
        parts = Path(name).parts
        assert parts[0] == "tracking" and parts[-1].startswith("mlflow_"), f"{name} imports mlflow"


def test_tracking_base_stands_alone():
    """The protocol every tracker builds on: below all of tracking/, so no cycle can run through it."""
    for name in imported_modules(PACKAGE / "tracking" / "base.py"):
        assert not name.startswith("ntil_ds."), f"tracking/base.py imports {name}"


# Importers of tracking/mlflow_*.py: any other would put mlflow's 1.6 s import on every rank. build.py
# imports the tracker lazily on the main rank; the CLI and the comparison grid and its merge run as one
# process.
MLFLOW_MODULE_IMPORTERS = {
    ("tracking", "build.py"),
    ("tracking", "__main__.py"),
    ("comparison", "grid.py"),
    ("comparison", "merge.py"),
}


def test_only_build_and_single_process_tools_import_the_mlflow_tracking_modules():
    for path in library_files():
        parts = path.relative_to(PACKAGE).parts
        if parts in MLFLOW_MODULE_IMPORTERS or (parts[0] == "tracking" and parts[-1].startswith("mlflow_")):
            continue
        users = [n for n in imported_modules(path) if n.startswith("ntil_ds.tracking.mlflow_")]
        assert not users, f"{path} imports {users}: call ntil_ds.tracking.build_tracker instead"


def test_leaf_packages_are_independent():
    for path in library_files():
        parts = path.relative_to(PACKAGE).parts
        if parts[0] not in LEAF_PACKAGES:
            continue
        for name in imported_modules(path):
            assert top(name) not in ("deepspeed", "mlflow"), f"{path} imports {name}"
            if name.startswith("ntil_ds."):
                sub = name.split(".")[1]
                allowed = {parts[0], *FOUNDATION}
                assert sub in allowed, (
                    f"{path} imports {name}: {parts[0]}/ may only use {', '.join(FOUNDATION)}"
                )


@pytest.mark.parametrize("position", range(len(FOUNDATION)))
def test_foundation_modules_import_nothing_above_them(position):
    """The foundation, in order: each module may use only those before it (config builds on typed_config)."""
    name = FOUNDATION[position]
    below = {f"ntil_ds.{lower}" for lower in FOUNDATION[:position]}
    for imported in imported_modules(PACKAGE / f"{name}.py"):
        allowed = not imported.startswith("ntil_ds.") or any(
            imported == lower or imported.startswith(f"{lower}.") for lower in below
        )
        assert allowed, f"{name}.py imports {imported}"


def test_no_grab_bag_modules():
    assert not [p for p in library_files() if p.stem in ("utils", "helpers", "misc", "common")]


# docker/verify_stack.py runs inside the image before the project is installed: a script, not a module.
PATH_LOADERS_ALLOWED = {"tests/unit/test_container_pins.py"}


def test_nothing_is_loaded_by_file_path():
    loaders = [
        str(p.relative_to(ROOT))
        for p in code_files(*CODE_FOLDERS, "tests")
        if "spec_from_file_location" in p.read_text() and p != Path(__file__).resolve()
    ]
    loaders = [name for name in loaders if name not in PATH_LOADERS_ALLOWED]
    assert not loaders, f"modules loaded from a file path (import them, or call the CLI's main): {loaders}"
    library_uses_launch = [
        str(p.relative_to(ROOT))
        for p in library_files()
        if any(top(n) == "launch" for n in imported_modules(p))
    ]
    assert not library_uses_launch, (
        f"the library imports launch/ (move that logic into ntil_ds/): {library_uses_launch}"
    )
    path_hacks = [str(p.relative_to(ROOT)) for p in code_files("launch") if "sys.path" in p.read_text()]
    assert not path_hacks, f"launch/ files edit sys.path (the package is installed): {path_hacks}"
