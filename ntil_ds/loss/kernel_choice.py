"""Whether the Triton kernels can run on a device: one probe per process and device, shared by every
kernel="auto" / number_stage="auto" choice of the loss (the vocabulary stage, the labelled head, the number
stage).

`import triton` succeeding says little. At the first launch on a GPU Triton compiles its driver stub and
the kernel's launcher with the host C compiler against the Python headers, and compiles the kernel itself
(LLVM, ptxas): an image without gcc or Python.h (CUDA runtime images long shipped without gcc), a broken
ptxas or a driver too old for the PTX fails only then, which for the loss is inside the first training
step. The probe makes that first launch up front with a trivial kernel (`triton_probe`), once per process
and device; "auto" takes the torch path when it fails, with one warning naming the cause. "triton" does not
probe: the kernels' own launch raises the original error.
"""

from __future__ import annotations

import warnings

import torch

# Where "auto" considers the kernels at all: CUDA. CPU tensors need Triton's interpreter, which is far
# slower than the torch path (the tests ask for it with kernel="triton"). Tests widen this to put the probe
# on the CPU, where, without the interpreter, Triton really cannot launch.
AUTO_DEVICE_TYPES = ("cuda",)

_failures: dict[str, str | None] = {}
_warned: set[str] = set()


def _device_key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def describe(error: BaseException) -> str:
    """The error as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"


def probe_failure(device_key: str) -> str | None:
    """None when a trivial Triton kernel compiles, launches and computes right on this device, else why
    not (one line). Cached: the probe runs once per process and device."""
    if device_key not in _failures:
        try:
            from ntil_ds.loss import triton_probe  # ImportError without Triton

            triton_probe.launch(torch.device(device_key))
        except Exception as error:  # anything a first launch raises: no compiler, a compile error, ...
            _failures[device_key] = describe(error)
        else:
            _failures[device_key] = None
    return _failures[device_key]


def auto_uses_triton(device: torch.device, what: str) -> bool:
    """Whether "auto" runs the Triton kernels of `what` (for the warning) on tensors on `device`."""
    if device.type not in AUTO_DEVICE_TYPES:
        return False
    key = _device_key(device)
    # A CUDA graph being captured cannot take the probe's synchronising launch; the capture's warm-up (run
    # eagerly first, as CUDA graphs require) has probed already, else the kernels run as without a probe.
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if device.type == "cuda" and key not in _failures and capturing:
        return True
    failure = probe_failure(key)
    if failure is None:
        return True
    if key not in _warned:  # one warning per process and device, whichever stage probes first
        _warned.add(key)
        warnings.warn(
            f"Triton cannot run on {key} ({failure}); kernel='auto' and number_stage='auto' take the torch "
            f"path for {what} and the rest of the loss in this process (slower, same numbers). Install gcc "
            "and the Python headers (python3-dev) for Triton, or set loss.kernel: torch and "
            "loss.number_stage: eager to choose that path without this warning.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False
