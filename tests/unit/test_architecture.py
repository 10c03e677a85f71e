"""The import rules of docs/design/architecture.md, enforced by parsing the library's imports.

config -> dist/loss/data/model/tiny -> engine/checkpoint/tracking -> trainer -> launch.
loss, data, model and tiny never import each other, deepspeed or mlflow; only engine.py imports deepspeed;
exactly one module under tracking/ imports mlflow.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ntil_ds"
LEAF_PACKAGES = ("loss", "data", "model", "tiny")


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


def test_mlflow_imported_in_one_tracking_module():
    users = [
        p.relative_to(PACKAGE).parts
        for p in library_files()
        if any(top(n) == "mlflow" for n in imported_modules(p))
    ]
    assert len(users) <= 1 and all(parts[0] == "tracking" for parts in users), users


@pytest.mark.parametrize("lower", ["config.py", "dist.py"])
def test_foundation_modules_import_nothing_above_them(lower):
    for name in imported_modules(PACKAGE / lower):
        assert not name.startswith("ntil_ds."), f"{lower} imports {name}"


def test_no_grab_bag_modules():
    assert not [p for p in library_files() if p.stem in ("utils", "helpers", "misc", "common")]
