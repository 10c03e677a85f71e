"""The repository stands alone: no file points at design notes, golden values or scripts that a user who
clones it does not have (they were copied in: docs/design/, tests/unit/loss_golden/)."""

from __future__ import annotations

import subprocess

from tests.conftest import REPO_ROOT

# Written in pieces so that this file does not match itself.
OUTSIDE = [
    "../" + "shared",
    "shared/" + "golden",
    "shared/" + "design",
    "shared/" + "gpu",
    "NTIL_" + "SPEC.md",
    "FIELD_" + "NOTES",
    "ARCHITECTURE" + ".md",
]


def test_no_file_points_outside_the_repository():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    offenders = []
    for name in listed:
        path = REPO_ROOT / name
        if not path.is_file() or path.suffix in (".png", ".jpg", ".pt", ".safetensors"):
            continue
        text = path.read_text(errors="ignore")
        offenders += [f"{name}: {pattern}" for pattern in OUTSIDE if pattern in text]
    assert not offenders, offenders
