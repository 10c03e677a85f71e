"""A trivial Triton kernel whose first launch on a device shows whether Triton works there (see
`kernel_choice`): it takes the same steps as the loss kernels' first launch (the driver stub and the
launcher built with the host C compiler, the kernel compiled, launched) in well under a second."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LANES = 16


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)


def launch(device: torch.device) -> None:
    """Run the kernel on `device`; raise whatever Triton raises, or if the values come back wrong."""
    x = torch.arange(_LANES, dtype=torch.float32, device=device)
    y = torch.zeros_like(x)
    if device.type == "cuda":
        with torch.cuda.device(device):  # Triton launches on the current device
            _add_one_kernel[(1,)](x, y, _LANES, BLOCK=_LANES)
    else:
        _add_one_kernel[(1,)](x, y, _LANES, BLOCK=_LANES)
    if not torch.equal(y.cpu(), (x + 1).cpu()):  # the copy synchronises: a launch error surfaces here
        raise RuntimeError(f"a trivial Triton kernel computed wrong values on {device}")
