"""Vocab-parallel NTILLoss on the Triton kernel (Triton's interpreter, CPU tensors) on 2 and 3 gloo ranks.

Each rank runs the kernel on its uneven vocabulary shard (1003 = 502 + 501 = 335 + 334 + 334) and must
match the unsharded torch-path loss: every output, each slice's gradient, fp32 and bf16, digits on one
shard / spread / straddling a boundary, Gumbel noise, the signed/decimal options, an all-ignored batch.
The collectives are counted: exactly the two all-reduces of the torch path, same bytes. Kernel calls are
counted too, so a silent fallback to the torch path would fail. Shapes are small (the interpreter runs
every program in Python).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.test_vocab_parallel import (
    FIELDS,
    TrafficCounter,
    _assert_same_on_all_ranks,
    _digit_ids,
    _make_batch,
    _shard_bounds,
)
from tests.unit.test_loss_kernel import HAVE_TRITON

VOCAB = 1003


class KernelCalls:
    """Counts calls of the kernel wrappers (the proof that the sharded loss ran on the kernel)."""

    def __init__(self):
        from ntil_ds.loss import vocab_kernel

        self.module = vocab_kernel
        self.calls = {"forward_partials": 0, "forward_full": 0, "backward": 0}

    def __enter__(self):
        self._originals = {name: getattr(self.module, name) for name in self.calls}
        for name, original in self._originals.items():

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            setattr(self.module, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(self.module, name, original)


def _run_case(rank, world, group, *, placement, dtype, noise, options=False, all_ignored=False, seed=0):
    digit_ids = _digit_ids(placement, VOCAB, world)
    logits, labels = _make_batch(2, 8, VOCAB, digit_ids, seed=seed, dtype=dtype)
    kwargs = {"gumbel_noise_scale": noise}
    if options:  # '-' on the first shard, '.' on the last one
        kwargs |= {
            "signed_numbers": True,
            "minus_sign_id": 1,
            "decimal_numbers": True,
            "decimal_point_id": VOCAB - 2,
        }
        labels[1, 2], labels[1, 5], labels[0, 3] = 1, VOCAB - 2, 1
    if all_ignored:
        labels[:] = -100
    from ntil_ds.loss import NTILLoss

    reference = NTILLoss(digit_ids, kernel="torch", **kwargs)  # unsharded, torch path
    full = logits.clone().requires_grad_()
    expected = reference(full, labels, generator=torch.Generator().manual_seed(1234))
    expected.loss.backward()

    loss_fn = NTILLoss(digit_ids, kernel="triton", **kwargs)
    start, stop = _shard_bounds(VOCAB, world)[rank]
    local = logits[:, :, start:stop].clone().requires_grad_()
    generator = torch.Generator().manual_seed(1234 if rank == 0 else 99 + rank)
    with TrafficCounter() as traffic, KernelCalls() as kernel:
        out = loss_fn(local, labels, process_group=group, vocab_start=start, generator=generator)
        out.loss.backward()
    assert kernel.calls == {"forward_partials": 1, "forward_full": 0, "backward": 1}, kernel.calls
    assert traffic.calls == {"all_reduce": 2}, traffic.calls
    positions, columns = 16, 10 + (1 if options else 0)
    payload = 20 if noise > 0 else 0
    assert traffic.bytes == positions * 4 * (1 + 3 + columns + payload), traffic.bytes

    value_tol = {"rtol": 2e-6, "atol": 1e-6}
    grad_tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
    for field in FIELDS:
        torch.testing.assert_close(getattr(out, field), getattr(expected, field), **value_tol, msg=field)
    assert torch.equal(out.num_tokens, expected.num_tokens)
    assert local.grad.dtype == dtype
    torch.testing.assert_close(local.grad.float(), full.grad[:, :, start:stop].float(), **grad_tol)
    _assert_same_on_all_ranks(torch.stack([getattr(out, field).detach().float() for field in FIELDS]), group)
    if all_ignored:
        assert out.loss.item() == 0.0 and torch.count_nonzero(local.grad) == 0


def _check_group(rank, world, group) -> int:
    cases = [
        {"placement": "straddle", "dtype": torch.float32, "noise": 1.0},
        {"placement": "spread", "dtype": torch.bfloat16, "noise": 0.0},
        {"placement": "one_shard", "dtype": torch.float32, "noise": 0.0},
        {"placement": "straddle", "dtype": torch.bfloat16, "noise": 1.0, "options": True},
        {"placement": "spread", "dtype": torch.float32, "noise": 1.0, "all_ignored": True},
    ]
    for seed, case in enumerate(cases):
        _run_case(rank, world, group, seed=seed, **case)
    return len(cases)


def _worker(rank, world_sizes, init_file, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=max(world_sizes))
    try:
        results = {}
        for world in world_sizes:
            group = dist.new_group(list(range(world)))  # every rank must take part in creating it
            if rank < world:
                results[world] = _check_group(rank, world, group)
        if rank == 0:
            Path(result_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not installed (pip install -c constraints/cpu.txt -e '.[dev]')"
)
def test_vocab_parallel_kernel_equals_unsharded_torch_loss_on_2_and_3_ranks(tmp_path, monkeypatch):
    # The spawned ranks inherit this environment; TRITON_INTERPRET must be set before they define the
    # kernels. monkeypatch restores this process's environment afterwards.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    world_sizes = (2, 3)
    result_file = tmp_path / "result.json"
    mp.spawn(_worker, args=(world_sizes, str(tmp_path / "rendezvous"), str(result_file)), nprocs=3, join=True)
    assert json.loads(result_file.read_text()) == {"2": 5, "3": 5}
