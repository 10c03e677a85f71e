"""Every Triton kernel of the project through Triton's real compiler, without a GPU.

The interpreter tests (test_loss_kernel.py, test_number_kernel.py, test_loss_grouped.py) run the kernels'
Python, not the compiler: they cannot see a type error in code generation, a global the compiler cannot
read, register pressure or spills. Here each kernel is compiled by `triton.compile` for sm_80, sm_90 and
sm_100, in every dtype and constexpr variant that the wrappers can launch there, with the block and warps
they launch it with (vocab_kernel.LAUNCH, number_kernel.FORWARD_* / BACKWARD_*, grouped_kernel.ROWS /
ROW_WARPS / SEQUENCE_*); `cuobjdump --dump-resource-usage` (shipped in the triton wheel) reads registers and
spills of the cubin. Asserted: 0 spill bytes and no atomic instruction in the PTX (the loss is
deterministic because none of its sums uses atomics). The register table is printed (`pytest -s`) with the
resident warps per SM those registers allow. ~45 s of CPU, in a fresh Triton cache.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ARCHITECTURES = (80, 90, 100)
REGISTERS_PER_SM = 65536  # sm_80, sm_90, sm_100
MAX_WARPS_PER_SM = 64
# Shared memory an SM gives its programs (the registers are the binding limit for these kernels).
SHARED_MEMORY_PER_SM = {80: 164 * 1024, 90: 228 * 1024, 100: 228 * 1024}
DTYPES = ("fp32", "bf16", "fp16")  # the logits dtypes the vocabulary kernels take
FLOAT_ARGUMENTS = {"log2_base", "tau", "digit_alpha", "abs_alpha", "mag_alpha"}
ATOMIC = re.compile(r"^\s*(@!?%\w+\s+)?(atom|red)\.", re.MULTILINE)


def signature(kernel, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Triton types of the kernel's parameters: the named pointers, fp32 scalars, i32 for the rest."""
    types = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in pointers:
            types[name] = pointers[name]
        else:
            types[name] = "fp32" if name in FLOAT_ARGUMENTS else "i32"
    return types


def vocab_variants(arch: int):
    """(kernel name, variant, kernel, signature, constexprs, warps) of vocab_kernel on `arch`."""
    from ntil_ds.loss import vocab_kernel

    for direction, kernel in (
        ("forward", vocab_kernel._forward_kernel),
        ("backward", vocab_kernel._backward_kernel),
    ):
        block, warps = vocab_kernel.LAUNCH[arch][direction]
        flag_sets = (
            [{"FINALIZE": True}, {"FINALIZE": False}]
            if direction == "forward"
            else [
                {"HAS_CE_GRAD": ce, "HAS_COLUMN_GRAD": col} for ce in (True, False) for col in (True, False)
            ]
        )
        # The largest block is what every real vocabulary launches (32000-152064 columns); a small one (1024:
        # vocabularies up to 1024, the tiny test models) in fp32 shows the other end compiles too.
        sizes = [(dtype, block) for dtype in DTYPES] + [("fp32", 1024)]
        for dtype, size in sizes:
            pointers = {
                name: "*fp32" for name in inspect.signature(kernel.fn).parameters if name.endswith("_ptr")
            }
            pointers.update({"logits_ptr": f"*{dtype}", "targets_ptr": "*i64", "column_ids_ptr": "*i64"})
            if direction == "backward":
                pointers["grad_ptr"] = f"*{dtype}"
            # K = 10 or 11 columns: 16 lanes. A grouped-digit table's widths 1-2 (110 columns: 128 lanes, the
            # backward's same-id matrix) and 1-3 (1,111: 2,048 lanes, distinct ids) in bf16, the training dtype.
            variants = [(flags, 16) for flags in (flag_sets if size == block else flag_sets[:1])]
            if size == block and dtype == "bf16":
                column_flags = [flags for flags in flag_sets if flags.get("HAS_COLUMN_GRAD", True)]
                variants += [(flags, lanes) for lanes in (128, 2048) for flags in column_flags]
            for flags, lanes in variants:
                constexprs = {**flags, "BLOCK": size, "LANES": lanes}
                if direction == "backward":
                    constexprs["DISTINCT_IDS"] = lanes > vocab_kernel.SAME_ID_MAX_LANES
                variant = f"{dtype} " + " ".join(f"{key}={int(value)}" for key, value in flags.items())
                yield (
                    f"vocab {direction}",
                    variant + (f" lanes={lanes}" if lanes != 16 else ""),
                    kernel,
                    signature(kernel, pointers, constexprs),
                    constexprs,
                    warps,
                )


def number_variants(arch: int):
    """The number stage: one variant each way (its modes are runtime flags, its tensors fp32)."""
    from ntil_ds.loss import number_kernel as nk

    integer_pointers = {"labels_ptr": "*i64", "unpack_ptr": "*i64", "digit_ids_ptr": "*i64"}
    integer_pointers.update({"layout_ptr": "*i32", "counts_ptr": "*i32"})
    for direction, kernel, block, warps in (
        ("forward", nk._forward_kernel, nk.FORWARD_BLOCK, nk.FORWARD_WARPS),
        ("backward", nk._backward_kernel, nk.BACKWARD_BLOCK, nk.BACKWARD_WARPS),
    ):
        names = inspect.signature(kernel.fn).parameters
        pointers = {name: integer_pointers.get(name, "*fp32") for name in names if name.endswith("_ptr")}
        constexprs = {"BLOCK": block}
        yield (
            f"number {direction}",
            "fp32",
            kernel,
            signature(kernel, pointers, constexprs),
            constexprs,
            warps,
        )


def grouped_variants(arch: int):
    """The grouped-digit number stage (grouped_kernel): the position and backward kernels at each table's
    lanes, next_power_of_2(10**max width) (widths {1}: 16, {1, 2}: 128, {1, 2, 3}: 1,024 of the 1,110
    columns), the sequence kernel once (its block does not depend on the table). Signed / decimal / noise /
    packed rows are runtime flags there (do_not_specialize), the tensors fp32: one variant each."""
    import triton

    from ntil_ds.loss import grouped_kernel as gk

    integer_pointers = {"labels_ptr": "*i64", "unpack_ptr": "*i64", "column_ptr": "*i32"}
    integer_pointers.update({"layout_ptr": "*i32", "counts_ptr": "*i32"})
    launches = [("sequence", gk._sequence_kernel, {"BLOCK": gk.SEQUENCE_BLOCK}, gk.SEQUENCE_WARPS, "")]
    for max_width in (1, 2, 3):
        lanes = {"ROWS": gk.ROWS, "LANES": triton.next_power_of_2(10**max_width)}
        for direction, kernel in (("position", gk._position_kernel), ("backward", gk._backward_kernel)):
            launches.append((direction, kernel, lanes, gk.ROW_WARPS, f" widths 1-{max_width}"))
    for direction, kernel, constexprs, warps, widths in launches:
        names = inspect.signature(kernel.fn).parameters
        pointers = {name: integer_pointers.get(name, "*fp32") for name in names if name.endswith("_ptr")}
        yield (
            f"grouped {direction}",
            f"fp32{widths}",
            kernel,
            signature(kernel, pointers, constexprs),
            constexprs,
            warps,
        )


def resource_usage(cubin: bytes, tmp_path: Path) -> dict[str, int]:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    text = subprocess.run(
        [str(cuobjdump), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return {key: int(re.search(rf"{key}:(\d+)", text).group(1)) for key in ("REG", "LOCAL")}


def resident_warps(registers: int, shared: int, warps: int, arch: int) -> int:
    """Warps an SM holds at once for these resources (registers are allocated 256 a warp)."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    programs = min(REGISTERS_PER_SM // (per_warp * warps), MAX_WARPS_PER_SM // warps)
    if shared:
        programs = min(programs, SHARED_MEMORY_PER_SM[arch] // shared)
    return programs * warps


def test_every_kernel_compiles_for_sm80_sm90_sm100_without_spills_or_atomics(tmp_path, monkeypatch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # compile for real, every run
    started = time.perf_counter()
    rows, failures = [], []
    for arch in ARCHITECTURES:
        for name, variant, kernel, types, constexprs, warps in [
            *vocab_variants(arch),
            *number_variants(arch),
            *grouped_variants(arch),
        ]:
            source = ASTSource(fn=kernel, signature=types, constexprs=constexprs)
            compiled = triton.compile(
                source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
            )
            usage = resource_usage(compiled.asm["cubin"], tmp_path)
            usage["SHARED"] = compiled.metadata.shared  # Triton's dynamic shared memory (reductions, scans)
            occupancy = resident_warps(usage["REG"], usage["SHARED"], warps, arch)
            block = constexprs.get("BLOCK") or f"{constexprs['ROWS']}x{constexprs['LANES']}"
            rows.append((name, variant, arch, block, warps, usage, occupancy))
            where = f"{name} {variant} sm_{arch}"
            if usage["LOCAL"]:
                failures.append(f"{where}: {usage['LOCAL']} bytes of spills")
            if ATOMIC.search(compiled.asm["ptx"]):
                failures.append(f"{where}: an atomic instruction in the PTX (sums must have a fixed order)")
    print(f"\n{len(rows)} compiled kernels in {time.perf_counter() - started:.0f} s")
    print(f"{'kernel':16s} {'variant':37s} {'arch':6s} {'block':>7s} {'warps':>5s} {'regs':>4s} "
          f"{'spill B':>7s} {'shared B':>8s} {'warps/SM':>8s}")  # fmt: skip
    for name, variant, arch, block, warps, usage, occupancy in rows:
        print(f"{name:16s} {variant:37s} sm_{arch:<3d} {block!s:>7s} {warps:5d} {usage['REG']:4d} "
              f"{usage['LOCAL']:7d} {usage['SHARED']:8d} {occupancy:8d}")  # fmt: skip
    assert not failures, "\n".join(failures)
    # Every architecture, every kernel: the wrappers can launch nothing that was not compiled here.
    assert {(row[0], row[2]) for row in rows} == {
        (name, arch) for name in ("vocab forward", "vocab backward", "number forward", "number backward",
                                  "grouped position", "grouped sequence", "grouped backward")
        for arch in ARCHITECTURES
    }  # fmt: skip
    # The vocabulary kernels at a grouped table's columns (widths 1-2 and 1-3), forward and backward.
    assert {(row[0], row[1].split()[-1]) for row in rows if "lanes=" in row[1]} == {
        (f"vocab {direction}", f"lanes={lanes}")
        for direction in ("forward", "backward")
        for lanes in (128, 2048)
    }
    # The grouped stage at every table a tokenizer probe can give (widths 1, 1-2, 1-3): its lanes.
    assert {row[1] for row in rows if row[0] == "grouped backward"} == {
        f"fp32 widths 1-{width}" for width in (1, 2, 3)
    }
