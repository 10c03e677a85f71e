"""The import rules of docs/design/architecture.md, enforced by parsing the library's imports.

config -> dist/loss/data/model -> engine/checkpoint/tracking -> trainer -> launch.
loss, data and model never import each other, deepspeed or mlflow; only engine.py imports deepspeed;
only tracking/mlflow_*.py import mlflow,
and only tracking/build.py (lazily) and the tracking CLI import those; tracking/base.py is below them all.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ntil_ds"
LEAF_PACKAGES = ("loss", "data", "model")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the file's package
                base = path.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level]
                names.add(".".join((*base, node.module or "")).rstrip("."))
            else:
                names.add(node.module or "")
    return names


def library_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 5, "the library is missing"
    return files


def top(name: str) -> str:
    return name.split(".")[0]


def test_leaf_packages_are_independent():
    for path in library_files():
        parts = path.relative_to(PACKAGE).parts
        if parts[0] not in LEAF_PACKAGES:
            continue
        for name in imported_modules(path):
            assert top(name) not in ("deepspeed", "mlflow"), f"{path} imports {name}"
            if name.startswith("ntil_ds."):
                sub = name.split(".")[1]
                allowed = {parts[0], "config", "dist"}
                assert sub in allowed, f"{path} imports {name}: {parts[0]}/ may only use config and dist"


def test_only_engine_imports_deepspeed():
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in library_files()
        if any(top(n) == "deepspeed" for n in imported_modules(p))
    ]
    assert offenders in ([], ["engine.py"]), f"deepspeed imported outside engine.py: {offenders}"


def test_mlflow_imported_only_in_the_mlflow_tracking_modules():
    users = [
        p.relative_to(PACKAGE).parts
        for p in library_files()
        if any(top(n) == "mlflow" for n in imported_modules(p))
    ]
    assert users, "no module imports mlflow: the rule below checks nothing"
    offenders = [u for u in users if not (u[0] == "tracking" and u[-1].startswith("mlflow_"))]
    assert not offenders, f"mlflow imported outside tracking/mlflow_*.py: {offenders}"


def test_tracking_base_imports_nothing_from_tracking():
    """The protocol every tracker builds on: below all of tracking/, so no cycle can run through it."""
    for name in imported_modules(PACKAGE / "tracking" / "base.py"):
        assert not name.startswith("ntil_ds."), f"tracking/base.py imports {name}"


def test_only_build_and_the_cli_import_the_mlflow_tracking_modules():
    """Any other importer would put mlflow's 1.6 s import on every rank (build imports it lazily)."""
    allowed = {("tracking", "build.py"), ("tracking", "__main__.py")}
    for path in library_files():
        parts = path.relative_to(PACKAGE).parts
        if parts in allowed or (parts[0] == "tracking" and parts[-1].startswith("mlflow_")):
            continue
        users = [n for n in imported_modules(path) if n.startswith("ntil_ds.tracking.mlflow_")]
        assert not users, f"{path} imports {users}: call ntil_ds.tracking.build_tracker instead"


@pytest.mark.parametrize("lower", ["config.py", "dist.py"])
def test_foundation_modules_import_nothing_above_them(lower):
    for name in imported_modules(PACKAGE / lower):
        assert not name.startswith("ntil_ds."), f"{lower} imports {name}"


def test_no_grab_bag_modules():
    assert not [p for p in library_files() if p.stem in ("utils", "helpers", "misc", "common")]
