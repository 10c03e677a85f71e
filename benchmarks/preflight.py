"""The first GPU step of benchmarks/gpu_check.sh (<= 20 s): what this machine has, and so which later
steps can run.

    python -m benchmarks.preflight --out DIR        # writes DIR/preflight.json as it goes
    python -m benchmarks.preflight --step all --from DIR/preflight.json   # each step: run|skip, why, args

Findings, each section written to preflight.json as soon as it is known (a kill keeps what finished):

- versions of Python, torch, CUDA, triton, deepspeed, transformers, liger-kernel and flash-attn, each
  "absent (why)" when it does not import. deepspeed, transformers, liger and flash-attn are imported
  in subprocesses (in parallel, bounded): one that hangs or crashes on import cannot take the preflight
  with it, and this process never imports transformers, so the CUDA probe does not depend on it;
- the modules of the wheel manifest (benchmarks/gpu_wheels.txt) that do not import, in one line;
- a host C compiler ($CC, gcc, cc or clang) and the Python headers (sysconfig's include folder has
  Python.h): Triton compiles its launcher stub with them at the first launch of every kernel;
- one trivial Triton launch; one NTILLoss forward + backward with kernel="triton" (and the Triton
  number stage) against kernel="torch" with the eager number stage (max abs difference of the loss
  parts and of the gradient); a torch.profiler count of GPU launches for the default loss's step.

Without CUDA everything still runs and reports cuda absent (TRITON_INTERPRET=1 runs the Triton checks
on CPU tensors in Triton's interpreter). The "steps" section says, per later step of gpu_check.sh,
whether it runs and why not, e.g. no Triton launch: the loss table keeps only its torch rows and the
head table is skipped; no transformers: no 2B step, but the loss table still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

MANIFEST = Path(__file__).with_name("gpu_wheels.txt")
# label -> module, each imported in its own process (they import torch, the slow part; one that hangs
# delays no other)
ISOLATED = {"deepspeed": "deepspeed", "accelerate": "accelerate", "transformers": "transformers",
            "liger": "liger_kernel", "flash_attn": "flash_attn"}  # fmt: skip
IMPORT_TIMEOUT_S = float(os.environ.get("PREFLIGHT_IMPORT_TIMEOUT_S", "15"))  # all the imports together
# The steps of gpu_check.sh that this module decides (in the script's order).
STEPS = ("gpu_tests_loss", "gpu_tests_head", "gpu_tests_throughput", "loss_table", "step_2b", "head_table",
         "compile_test")  # fmt: skip
KERNEL_METHODS = "cross_entropy,liger,ntil,ntil_eager"
TORCH_METHODS = "cross_entropy,ntil_torch"
MIN_TRANSFORMERS = (5, 24)
DIGITS = [17, 3, 25, 8, 30, 11, 2, 29, 14, 21]
TOLERANCE = 1e-4  # fp32, |loss parts| ~ 10, |grad| <= 2: Triton's exp/log approximations are ~1e-7 relative


def manifest_entries(path: Path = MANIFEST) -> list[tuple[str, str]]:
    """(distribution, module) per line of the wheel manifest; '#' starts a comment."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValueError(f"{path}:{number}: expected 'distribution module', got {line!r}")
        entries.append((fields[0], fields[1]))
    return entries


class Findings(dict):
    """The report; every update rewrites the JSON file (tmp + rename: never half a file)."""

    def __init__(self, path: Path | None) -> None:
        super().__init__()
        self.path = path

    def set(self, key: str, value) -> None:
        self[key] = value
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self, indent=1, default=str) + "\n")
            tmp.replace(self.path)


def _error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


_IMPORT_SCRIPT = r"""
import contextlib, importlib, json, sys
for name in sys.argv[1:]:
    try:
        with contextlib.redirect_stdout(sys.stderr):  # a package that prints on import cannot spoil the line
            module = importlib.import_module(name)
        version = getattr(module, "__version__", None)
        if version is None:  # liger_kernel has none: its distribution's
            import importlib.metadata as md
            dists = md.packages_distributions().get(name.split(".")[0], [])
            version = md.version(dists[0]) if dists else "unknown"
        result = {"version": str(version)}
    except BaseException as error:
        text = f"{type(error).__name__}: {error}".strip().splitlines()
        result = {"error": (text[0] if text else type(error).__name__)[:300]}
    print("\nPREFLIGHT_IMPORT " + json.dumps([name, result]), flush=True)  # one line per module, as it goes
"""


def start_import(modules: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _IMPORT_SCRIPT, *modules],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def finish_import(process: subprocess.Popen, modules: list[str], deadline: float) -> dict[str, dict]:
    """Each module's {"version"} or {"error"}: one that hangs (and those after it) or kills the process
    is an error; those imported before it keep their result."""
    try:
        stdout, stderr = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        why = f"import process died: {(stderr.strip().splitlines() or [f'exit {process.returncode}'])[-1]}"
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, _ = process.communicate()
        why = f"import did not finish in {IMPORT_TIMEOUT_S:.0f} s"
    results = {}
    for line in stdout.splitlines():
        if line.startswith("PREFLIGHT_IMPORT "):
            name, result = json.loads(line.split(" ", 1)[1])
            results[name] = result
    return {m: results.get(m, {"error": why[:300]}) for m in modules}


def _version_or_absent(result: dict) -> str:
    return result["version"] if "version" in result else f"absent ({result['error']})"


def compiler() -> dict:
    """What Triton's runtime/build.py would use: $CC, else gcc/cc/clang on PATH."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["gcc", "cc", "clang"]
    for name in names:
        path = shutil.which(name)
        if path:
            try:
                out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5)
                version = (out.stdout.splitlines() or ["?"])[0]
            except (OSError, subprocess.TimeoutExpired) as error:
                version = f"--version failed: {_error(error)}"
            return {"present": True, "path": path, "version": version}
    return {"present": False, "looked_for": names}


def python_headers() -> dict:
    include = sysconfig.get_paths().get("include", "")
    return {"include": include, "python_h": bool(include) and Path(include, "Python.h").is_file()}


def _kernel_device(torch, cuda: bool):
    if cuda:
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")  # Triton's interpreter runs kernels on CPU tensors
    return None


def triton_launch(torch, device) -> dict:
    """The loss's own probe (`ntil_ds.loss.triton_probe`, what kernel="auto" runs): a trivial kernel
    compiled, launched and its values checked; it raises when any of that fails."""
    from ntil_ds.loss import triton_probe

    started = time.perf_counter()
    triton_probe.launch(device)
    return {"seconds": round(time.perf_counter() - started, 3)}


def _batch(torch, device, batch=2, length=64, vocab=1003):
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    digits = torch.rand(batch, length, generator=generator) < 0.4
    labels[digits] = torch.tensor(DIGITS)[torch.randint(0, 10, (int(digits.sum()),), generator=generator)]
    labels[torch.rand(batch, length, generator=generator) < 0.3] = -100
    logits = torch.randn(batch, length, vocab, generator=generator) * 2
    return logits.to(device), labels.to(device)


def _forward_backward(loss_fn, logits, labels):
    leaf = logits.detach().clone().requires_grad_()
    out = loss_fn(leaf, labels)
    out.loss.backward()
    return out, leaf.grad


def ntil_against_torch(torch, device) -> dict:
    """kernel="triton" + the Triton number stage against kernel="torch" + eager, no noise, fp32."""
    from ntil_ds.loss import NTILLoss

    logits, labels = _batch(torch, device)
    kernels = NTILLoss(DIGITS, gumbel_noise_scale=0.0, kernel="triton", number_stage="triton")
    reference = NTILLoss(DIGITS, gumbel_noise_scale=0.0, kernel="torch", number_stage="eager")
    started = time.perf_counter()
    out, grad = _forward_backward(kernels, logits, labels)
    expected, expected_grad = _forward_backward(reference, logits, labels)
    parts = ("loss", "ntil", "emd", "rel", "mag", "ce_sum")
    diff = max(float((getattr(out, p) - getattr(expected, p)).detach().abs().max()) for p in parts)
    grad_diff = float((grad - expected_grad).abs().max())
    return {
        "shape": list(logits.shape),
        "max_abs_diff_parts": diff,
        "max_abs_diff_grad": grad_diff,
        "tolerance": TOLERANCE,
        "ok": diff <= TOLERANCE and grad_diff <= TOLERANCE,
        "seconds": round(time.perf_counter() - started, 3),
    }


def launch_count(torch, device) -> dict:
    """GPU activities (kernels, memsets, copies) of one default NTILLoss forward + backward, warm."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from ntil_ds.loss import NTILLoss

    loss_fn = NTILLoss(DIGITS)  # kernel="auto", number_stage="auto": what training runs
    logits, labels = _batch(torch, device)
    _forward_backward(loss_fn, logits, labels)  # compiled and allocated outside the count
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _forward_backward(loss_fn, logits, labels)
        torch.cuda.synchronize()
    launches = sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)
    return {"launches": launches, "docs_expect": 28, "limit_in_tests": 60}  # docs/loss.md


def _version_tuple(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def decide(f: dict) -> dict[str, dict]:
    """Per later step of gpu_check.sh: {"run": bool, "reason": str, and what it should pass}."""
    cuda = f.get("cuda", {}).get("available", False)
    missing = set(f.get("manifest", {}).get("missing_modules", {}))
    triton_ok = f.get("triton_launch", {}).get("ok", False)
    versions = f.get("versions", {})
    transformers = versions.get("transformers", "absent")
    no_transformers = transformers.startswith("absent") and f"transformers {transformers}"
    # Older than the pin: run anyway (a failure there is a finding), but say so beside the step.
    old = not no_transformers and _version_tuple(transformers) < MIN_TRANSFORMERS
    pin_note = f"transformers {transformers} is older than the pin {'.'.join(map(str, MIN_TRANSFORMERS))}"

    def need(*reasons):
        for reason in reasons:
            if reason:
                return {"run": False, "reason": reason}
        return {"run": True, "reason": ""}

    no_cuda = not cuda and f"cuda absent ({f.get('cuda', {}).get('why', 'not probed')})"
    no_pytest = "pytest" in missing and "pytest does not import"
    no_triton = not triton_ok and ("no Triton launch: " + f.get("triton_launch", {}).get("error", "not run"))
    throughput_missing = sorted(missing & {"psutil", "PIL", "yaml", "pydantic"})
    steps = {
        "gpu_tests_loss": need(no_cuda, no_pytest),
        "gpu_tests_head": need(no_cuda, no_pytest),
        "gpu_tests_throughput": need(
            no_cuda,
            no_pytest,
            no_transformers,
            throughput_missing and f"missing: {', '.join(throughput_missing)}",
        ),
        "loss_table": {
            **need(no_cuda),
            "methods": KERNEL_METHODS if triton_ok else TORCH_METHODS,
            "note": "" if triton_ok else f"kernel rows left out ({no_triton})",
        },
        "step_2b": {
            **need(
                no_cuda,
                no_transformers,
                *(f"missing: {m}" for m in ("deepspeed", "accelerate", "yaml", "pydantic") if m in missing),
                versions.get("deepspeed", "absent").startswith("absent") and "deepspeed does not import",
            ),
            # without a Triton launch the torch paths: Liger's kernels and the loss kernels are Triton
            "overrides": "" if triton_ok else "model.kernels=none loss.kernel=torch loss.number_stage=eager",
            "note": pin_note if old else "",
        },
        "head_table": need(no_cuda, no_triton, "yaml" in missing and "missing: yaml"),
        "compile_test": need(
            no_cuda, no_pytest, no_triton, not f.get("compiler", {}).get("present") and "no C compiler"
        ),
    }
    return steps


def run(out: Path | None) -> Findings:
    started = time.monotonic()
    f = Findings(out / "preflight.json" if out else None)
    f.set("python", {"version": sys.version.split()[0], "executable": sys.executable, **python_headers()})
    f.set("compiler", compiler())
    f.set("env", {k: os.environ.get(k, "") for k in ("TRITON_INTERPRET", "DS_ACCELERATOR", "CC", "OUT")})

    # The isolated imports start first and run while this process probes torch and CUDA.
    deadline = time.monotonic() + IMPORT_TIMEOUT_S
    entries = manifest_entries()
    isolated = {label: start_import([module]) for label, module in ISOLATED.items()}
    # + yaml: the config the head table and the 2B jobs read, which transformers brings (so not carried)
    manifest_modules = sorted({module for _, module in entries} | {"yaml"})
    light = [m for m in manifest_modules if m not in ISOLATED.values()]  # the rest, in one process
    manifest_process = start_import(light)

    versions = {"python": sys.version.split()[0]}
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = str(torch.version.cuda or "absent (a CPU build of torch)")
    except Exception as error:
        torch = None
        versions["torch"] = versions["cuda"] = f"absent ({_error(error)})"
    try:
        import triton

        versions["triton"] = triton.__version__
    except Exception as error:
        triton = None
        versions["triton"] = f"absent ({_error(error)})"
    f.set("versions", versions)

    cuda = {"available": False}
    if torch is not None:
        try:
            if torch.cuda.is_available():
                cuda = {
                    "available": True,
                    "device": torch.cuda.get_device_name(),
                    "capability": ".".join(map(str, torch.cuda.get_device_capability())),
                    "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                }
            else:
                cuda["why"] = "torch.cuda.is_available() is False"
        except Exception as error:
            cuda["why"] = _error(error)
    else:
        cuda["why"] = "torch does not import"
    f.set("cuda", cuda)
    device = _kernel_device(torch, cuda["available"]) if torch is not None else None

    no_triton = triton is None and "triton does not import"
    _check(f, "triton_launch", triton_launch, torch, device, no_triton)
    _check(f, "ntil_triton_vs_torch", ntil_against_torch, torch, device, no_triton)

    imported = {}
    for label, process in isolated.items():
        imported.update(finish_import(process, [ISOLATED[label]], deadline))
        versions[label] = _version_or_absent(imported[ISOLATED[label]])
    if not versions["flash_attn"].startswith("absent"):
        # the CUDA extension, which a flash-attn built for another torch fails to load (undefined symbol)
        ext = finish_import(start_import(["flash_attn_2_cuda"]), ["flash_attn_2_cuda"], deadline + 5)
        versions["flash_attn_cuda_extension"] = _version_or_absent(ext["flash_attn_2_cuda"])
    f.set("versions", versions)

    imported.update(finish_import(manifest_process, light, deadline))
    missing = {m: imported[m]["error"] for m in manifest_modules if "error" in imported[m]}
    listed = "; ".join(f"{m} ({e})" for m, e in missing.items())
    summary = f"missing: {listed}" if missing else "all import"
    f.set("manifest", {"file": str(MANIFEST), "missing_modules": missing, "summary": summary})
    f.set("transformers_imported_here", "transformers" in sys.modules)  # must stay False
    f.set("steps", decide(f))  # before the profiler's count, the slowest part: a kill keeps the decisions
    no_count = not cuda["available"] and "cuda absent (the profiler counts GPU launches)"
    _check(f, "launches", launch_count, torch, device, no_count)
    f.set("seconds", round(time.monotonic() - started, 2))
    return f


def _check(f: Findings, key: str, check, torch, device, impossible) -> None:
    """One check's finding: its result, or why it was skipped, or the error it raised (never a crash)."""
    why = "cuda absent" if device is None else impossible
    if not why and key != "triton_launch" and not f["triton_launch"].get("ok"):
        why = "no Triton launch"
    if why:
        f.set(key, {"ok": False, "skipped": why, "error": why})
        return
    try:
        f.set(key, {"ok": True, **check(torch, device)})
    except Exception as error:  # the finding, not a crash: later checks and steps still run
        f.set(key, {"ok": False, "error": _error(error)})


def print_report(f: Findings) -> None:
    v = f["versions"]
    print("versions: " + ", ".join(f"{k} {v[k]}" for k in v))
    c = f["cuda"]
    where = f"{c['device']} (sm {c['capability']}, {c['memory_gib']} GiB)" if c["available"] else ""
    print(f"cuda: {where or 'absent (' + c['why'] + ')'}")
    cc = f["compiler"]
    print(f"C compiler: {cc.get('path', 'absent') + ' ' + cc.get('version', '') if cc['present'] else 'absent'}; "
          f"Python.h: {'present' if f['python']['python_h'] else 'absent'} in {f['python']['include']}")  # fmt: skip
    for key in ("triton_launch", "ntil_triton_vs_torch", "launches"):
        print(f"{key}: {json.dumps(f[key])}")
    print(f"manifest modules: {f['manifest']['summary']}")
    for step, d in f["steps"].items():
        extra = "".join(f"; {k}: {d[k]}" for k in ("methods", "overrides", "note") if d.get(k))
        print(f"step {step}: {'run' if d['run'] else 'skip (' + d['reason'] + ')'}{extra}")
    print(f"preflight: {f['seconds']} s")


def step_decision(path: Path, step: str) -> str:
    """One line for the shell: 'run|skip<TAB>reason<TAB>extra' (extra: the loss table's methods or the 2B
    step's overrides; an empty field is '-'). Without a readable preflight.json: run, and say so."""
    if step not in STEPS:
        raise SystemExit(f"unknown step {step!r}; expected one of {', '.join(STEPS)}")
    try:
        decision = json.loads(path.read_text())["steps"][step]
    except (OSError, ValueError, KeyError) as error:
        return f"run\tno preflight decision ({_error(error)})\t-"
    extra = decision.get("methods") or decision.get("overrides") or "-"  # "-": none (tabs would collapse)
    return f"{'run' if decision['run'] else 'skip'}\t{decision['reason'] or '-'}\t{extra}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="folder for preflight.json (default: print only)")
    parser.add_argument("--step", help="print the decision for this gpu_check.sh step ('all': each) and exit")
    parser.add_argument("--from", dest="source", type=Path, help="--step: the preflight.json to read")
    args = parser.parse_args()
    if args.step:
        if args.source is None:
            parser.error("--step needs --from PREFLIGHT_JSON")
        for step in STEPS if args.step == "all" else [args.step]:  # all: one line per step, named
            print((f"{step}\t" if args.step == "all" else "") + step_decision(args.source, step))
        return
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    print_report(run(args.out))


if __name__ == "__main__":
    main()
