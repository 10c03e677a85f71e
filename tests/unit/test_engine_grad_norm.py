"""The step's grad norm on a non-finite step: DeepSpeed's ZeRO stages leave a Python float (inf) there, or None
when they skip the norm; `TrainingEngine.grad_norm` must put it on the engine's device, since the trainer
concatenates it with the step's device totals in `read_to_host` (on a GPU a CPU tensor there is "Expected all
tensors to be on the same device" instead of the non-finite report).

DeepSpeed's engine here is a stand-in with the two members `grad_norm` reads (`get_global_grad_norm`, `device`):
a real one on this machine has the CPU for its device, where a wrong device cannot show. The "meta" device
stands for the GPU: a tensor made anywhere else is on the wrong device."""

from __future__ import annotations

import math

import pytest
import torch

from ntil_ds.dist import read_to_host
from ntil_ds.engine import TrainingEngine


class _DeepSpeedEngine:
    def __init__(self, norm, device: torch.device) -> None:
        self.norm, self.device = norm, device

    def get_global_grad_norm(self):
        return self.norm


def engine_with(norm, device: torch.device) -> TrainingEngine:
    engine = TrainingEngine.__new__(TrainingEngine)  # no deepspeed.initialize: only grad_norm is under test
    engine.engine = _DeepSpeedEngine(norm, device)
    return engine


@pytest.mark.parametrize("norm", [float("inf"), float("nan"), 3.5, None, torch.tensor([2.0])])
def test_grad_norm_is_a_scalar_on_the_engines_device(norm):
    meta = torch.device("meta")
    got = engine_with(norm, meta).grad_norm()
    assert got.device == meta and got.dim() == 0
    if not isinstance(norm, torch.Tensor):
        assert got.dtype == torch.float64


@pytest.mark.parametrize(("norm", "expected"), [(float("inf"), math.inf), (None, math.nan), (3.5, 3.5)])
def test_the_step_report_reads_a_float_norm_with_the_device_totals(norm, expected):
    """The trainer's read of a step (`read_to_host({**totals, "grad_norm": ...})`): one concatenation of
    values that all share the engine's device and become host floats."""
    device = torch.device("cpu")
    totals = {
        "loss_sum": torch.tensor(6.0, dtype=torch.float64, device=device),
        "parts": torch.ones(2, device=device),
    }
    grad_norm = engine_with(norm, device).grad_norm()
    assert {t.device for t in (*totals.values(), grad_norm)} == {device}
    host = read_to_host({**totals, "grad_norm": grad_norm})
    assert host["loss_sum"] == 6.0 and host["parts"] == [1.0, 1.0]
    assert math.isnan(host["grad_norm"]) if math.isnan(expected) else host["grad_norm"] == expected


def test_read_to_host_of_nothing_is_empty():
    assert read_to_host({}) == {}
