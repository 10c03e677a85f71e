"""Check that a Python environment holds exactly the pinned stack, and fail with a clear message if not.

The image build runs it after each expensive layer, so a wrong CUDA base, a flash-attn wheel built for
another torch / C++ ABI, or DeepSpeed ops that silently were not compiled stop the build at that layer,
not on rank 3 of the first cluster job. It also runs on the CI venv (tests/unit/test_container_pins.py).

    python docker/verify_stack.py --pins constraints/cpu.txt constraints/cuda.txt \
        [--require torch deepspeed ...] [--all-pinned-except pip ...] [--cuda 13.0 | none] \
        [--deepspeed-ops fused_adam cpu_adam] [--deepspeed-accelerator cuda] [--import flash_attn ...]

Exit status 0 when every check holds, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

from packaging.version import Version


def normalize(name: str) -> str:
    """PEP 503 name: `Flash_Attn` and `flash-attn` are the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(paths: list[Path]) -> dict[str, Version]:
    """Parse `name==version` lines of constraints files; a package pinned twice is an error."""
    pins: dict[str, Version] = {}
    pinned_in: dict[str, Path] = {}
    for path in paths:
        for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
            if match is None:
                raise ValueError(f"{path}:{lineno}: expected an exact pin `name==version`, got {raw!r}")
            name = normalize(match.group(1))
            if name in pins:
                raise ValueError(
                    f"{path}:{lineno}: {name} is already pinned in {pinned_in[name]}: "
                    "pin each package in one file only"
                )
            pins[name] = Version(match.group(2))
            pinned_in[name] = path
    return pins


def version_problems(
    pins: dict[str, Version], required: list[str], unpinned_ok: list[str] | None
) -> list[str]:
    """Installed distributions that differ from their pin (public version: 2.13.0+cu130 == 2.13.0).

    With `unpinned_ok` (a list, possibly empty), every installed distribution not named there must be pinned.
    """
    installed = {
        normalize(d.metadata["Name"]): Version(d.version)
        for d in importlib.metadata.distributions()
        if d.metadata["Name"]  # a half-removed install can leave metadata without a name
    }
    problems = [
        f"{name} {installed[name]} is installed but {name}=={pinned} is pinned"
        for name, pinned in sorted(pins.items())
        if name in installed and Version(installed[name].public) != pinned
    ]
    for name in map(normalize, required):
        if name not in installed:
            problems.append(f"{name} is not installed")
        elif name not in pins:
            problems.append(f"{name} {installed[name]} is installed but not pinned in any constraints file")
    if unpinned_ok is not None:
        allowed = set(map(normalize, unpinned_ok)) | set(map(normalize, required))
        problems += [
            f"{name} {installed[name]} is installed but not pinned in any constraints file"
            for name in sorted(installed.keys() - pins.keys() - allowed)
        ]
    return problems


def build_constants(package: str, module: str) -> dict[str, object] | None:
    """Literal assignments of a file a package's build wrote (torch/version.py, DeepSpeed's build info).

    Read, not imported: importing torch or deepspeed takes seconds and probes for accelerators.
    None when the package is not installed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / f"{module}.py"
    constants = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        try:
            if isinstance(target, ast.Name):
                constants[target.id] = ast.literal_eval(value)
        except ValueError:
            continue  # computed at import time: not a build constant
    return constants


def cuda_problems(expected: str) -> list[str]:
    """torch must be built for the CUDA major.minor of the base image (DeepSpeed's op builder insists),
    or be the CPU build in an image without CUDA (`expected` is "none")."""
    torch_version = build_constants("torch", "version")
    if torch_version is None:
        return ["torch is not installed"]
    if expected == "none":
        if torch_version["cuda"] is None:
            return []
        return [
            f"torch {torch_version['__version__']} is built for CUDA {torch_version['cuda']}, but this image "
            "has no CUDA (CUDA_VERSION=none): install torch's CPU build, e.g. with the build arg "
            "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
        ]
    want = ".".join(expected.split(".")[:2])
    if torch_version["cuda"] is None:
        return [f"torch {torch_version['__version__']} is a CPU-only build, but CUDA {want} is expected"]
    have = ".".join(str(torch_version["cuda"]).split(".")[:2])
    if have != want:
        return [
            f"torch {torch_version['__version__']} is built for CUDA {have} but the image's CUDA is {want}: "
            f"set the build arg CUDA_VERSION to a {have}.x release, or TORCH_INDEX_URL to a "
            f"cu{want.replace('.', '')} index"
        ]
    return []


def deepspeed_build_problems(ops: list[str], accelerator: str | None) -> list[str]:
    """Ops that DeepSpeed's setup skipped (it only warns) or built for the wrong accelerator."""
    build_info = build_constants("deepspeed", "git_version_info_installed")
    if build_info is None:
        return ["deepspeed is not installed"]
    installed_ops = build_info["installed_ops"]
    problems = [
        f"DeepSpeed op {op} was not prebuilt (installed_ops[{op!r}] is {installed_ops.get(op)}); "
        "see the deepspeed build output for why"
        for op in ops
        if not installed_ops.get(op)
    ]
    if accelerator is not None and build_info["accelerator_name"] != accelerator:
        problems.append(
            f"DeepSpeed was built for accelerator {build_info['accelerator_name']!r}, not {accelerator!r}: "
            f"build it with DS_ACCELERATOR={accelerator} (a build without a visible GPU falls back to cpu)"
        )
    return problems


def import_problems(modules: list[str]) -> list[str]:
    """Import compiled extensions now: a torch / CUDA / C++ ABI mismatch shows up as an ImportError."""
    problems = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            problems.append(
                f"import {module} failed: {error} (an 'undefined symbol' means it was built against "
                "another torch, CUDA or C++ ABI: rebuild it with FLASH_ATTENTION_FORCE_BUILD=TRUE)"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pins", type=Path, nargs="+", required=True, help="constraints files")
    parser.add_argument("--require", nargs="*", default=[], help="distributions that must be installed")
    parser.add_argument(
        "--all-pinned-except",
        nargs="*",
        default=None,
        help="require every installed distribution to be pinned, except these (e.g. pip)",
    )
    parser.add_argument(
        "--cuda", help="CUDA version torch must be built for, e.g. 13.0.2; none: torch's CPU build"
    )
    parser.add_argument("--deepspeed-ops", nargs="*", default=[], help="ops that must be prebuilt")
    parser.add_argument("--deepspeed-accelerator", help="accelerator DeepSpeed was built for, e.g. cuda")
    parser.add_argument("--import", dest="modules", nargs="*", default=[], help="modules to import")
    args = parser.parse_args(argv)

    try:
        pins = read_pins(args.pins)
    except ValueError as error:
        print(f"verify_stack: {error}", file=sys.stderr)
        return 1
    problems = version_problems(pins, args.require, args.all_pinned_except)
    if args.cuda:
        problems += cuda_problems(args.cuda)
    if args.deepspeed_ops or args.deepspeed_accelerator:
        problems += deepspeed_build_problems(args.deepspeed_ops, args.deepspeed_accelerator)
    problems += import_problems(args.modules)

    for problem in problems:
        print(f"verify_stack: {problem}", file=sys.stderr)
    if not problems:
        print(f"verify_stack: ok ({len(pins)} pins, {', '.join(args.require) or 'no required packages'})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
