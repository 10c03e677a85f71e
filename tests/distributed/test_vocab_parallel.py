"""Vocab-parallel NTILLoss on 2, 3 and 4 gloo processes equals the unsharded loss on the full logits.

Four processes are spawned once (spawning is the slow part) and groups of 2, 3 and 4 of them run
every case in turn: vocabularies 1003
and 32003 split unevenly, digit ids on one shard / spread over all shards / straddling a shard
boundary, 30 % ignored labels, digit-free sequences, fp32 and bf16, Gumbel noise off and on, the
signed/decimal options, an all-ignored micro-batch. Each rank compares its loss, parts and slice
gradient with the unsharded NTILLoss, and the collectives are counted through a wrapper around
torch.distributed. The labelled head (loss.logits=labelled: the head's shard applied to the hidden states
of the labelled rows, in chunks) is compared the same way, with the gradients of the hidden states and of
the head's slice.
"""

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntil_ds.labelled_forward import loss_from_rows, row_inputs, row_stats
from ntil_ds.loss import NTILLoss
from ntil_ds.loss.labelled_head import OutputHead
from ntil_ds.model.tensor_parallel import VocabShard

FIELDS = ("loss", "ntil", "emd", "rel", "mag", "ce_mean", "ce_sum")
COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
]


def _shard_bounds(vocab: int, world: int) -> list[tuple[int, int]]:
    """Uneven contiguous shards, larger first (as DeepSpeed AutoTP splits 1003 into 502/501)."""
    sizes = [vocab // world + (1 if r < vocab % world else 0) for r in range(world)]
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def _digit_ids(placement: str, vocab: int, world: int) -> list[int]:
    bounds = _shard_bounds(vocab, world)
    if placement == "one_shard":  # all in the last shard, unsorted
        start = bounds[-1][0]
        return [start + 7 * i + 3 for i in (3, 1, 4, 0, 5, 9, 2, 6, 8, 7)]
    if placement == "spread":  # over every shard
        return [i * vocab // 10 + 5 for i in range(10)]
    boundary = bounds[0][1]  # "straddle": consecutive ids across the first boundary
    return list(range(boundary - 5, boundary + 5))


def _make_batch(batch, length, vocab, digit_ids, *, seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    digit_mask = torch.rand(batch, length, generator=generator) < 0.45
    digit_mask[0] = False  # a digit-free sequence
    picks = torch.randint(0, 10, (int(digit_mask.sum()),), generator=generator)
    labels[digit_mask] = torch.tensor(digit_ids)[picks]
    labels[torch.rand(batch, length, generator=generator) < 0.3] = -100
    logits = (torch.randn(batch, length, vocab, generator=generator) * 3).to(dtype)
    return logits, labels


class TrafficCounter:
    """Counts every torch.distributed collective call and the bytes of its tensor argument."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.bytes = 0
        self._originals = {}

    def __enter__(self):
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self._originals[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                tensor = args[0] if args else kwargs.get("tensor")
                if isinstance(tensor, torch.Tensor):
                    self.bytes += tensor.numel() * tensor.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _assert_same_on_all_ranks(values: torch.Tensor, group) -> None:
    high, low = values.clone(), values.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    assert torch.equal(high, low), f"ranks disagree: {high} vs {low}"


def _run_case(
    rank, world, group, *, vocab, placement, dtype, noise, options=False, all_ignored=False, seed=0
):
    digit_ids = _digit_ids(placement, vocab, world)
    batch, length = (3, 24) if vocab < 10_000 else (2, 12)
    logits, labels = _make_batch(batch, length, vocab, digit_ids, seed=seed, dtype=dtype)
    kwargs = {"gumbel_noise_scale": noise}
    if options:  # '-' on the first shard, '.' on the last one
        kwargs |= {
            "signed_numbers": True,
            "minus_sign_id": 1,
            "decimal_numbers": True,
            "decimal_point_id": vocab - 2,
        }
        labels[1, 3], labels[1, 10], labels[2, 6] = 1, vocab - 2, 1
    if all_ignored:
        labels[:] = -100
    loss_fn = NTILLoss(digit_ids, **kwargs)

    full = logits.clone().requires_grad_()
    expected = loss_fn(full, labels, generator=torch.Generator().manual_seed(1234))
    expected.loss.backward()

    start, stop = _shard_bounds(vocab, world)[rank]
    local = logits[:, :, start:stop].clone().requires_grad_()
    # Only the first rank's generator matters (its noise is sent to the others): give the other
    # ranks a different seed to show that their generators cannot make the ranks disagree.
    generator = torch.Generator().manual_seed(1234 if rank == 0 else 99 + rank)
    out = loss_fn(local, labels, process_group=group, vocab_start=start, generator=generator)
    out.loss.backward()

    tolerance = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-5, "atol": 1e-6}
    for field in FIELDS:
        torch.testing.assert_close(getattr(out, field), getattr(expected, field), **tolerance, msg=field)
    assert torch.equal(out.num_tokens, expected.num_tokens)
    grad_tolerance = (
        {"rtol": 1e-5, "atol": 1e-9} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-5}
    )
    torch.testing.assert_close(local.grad, full.grad[:, :, start:stop], **grad_tolerance)
    _assert_same_on_all_ranks(torch.stack([getattr(out, field).detach().float() for field in FIELDS]), group)
    if all_ignored:
        assert out.loss.item() == 0.0 and torch.count_nonzero(local.grad) == 0
    return out


def _run_labelled_case(rank, world, group, *, vocab, options, seed, hidden_size=16):
    """The labelled head on this rank's rows of the head against the whole head's logits."""
    digit_ids = _digit_ids("straddle", vocab, world)
    _, labels = _make_batch(3, 24, vocab, digit_ids, seed=seed, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 24, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.5
    kwargs = {"gumbel_noise_scale": 1.0}
    if options:
        kwargs |= {
            "signed_numbers": True,
            "minus_sign_id": 1,
            "decimal_numbers": True,
            "decimal_point_id": vocab - 2,
        }
        labels[1, 3], labels[1, 10], labels[2, 6] = 1, vocab - 2, 1
    loss_fn = NTILLoss(digit_ids, kernel="torch", **kwargs)

    full_hidden, full_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = loss_fn(full_hidden @ full_weight.t(), labels, generator=torch.Generator().manual_seed(1234))
    expected.loss.backward()

    start, stop = _shard_bounds(vocab, world)[rank]
    local_hidden, local_weight = hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()
    rows = (labels.flatten() != -100).nonzero().squeeze(1)
    noise_source = torch.Generator().manual_seed(1234 if rank == 0 else 99 + rank)
    targets, noise, payload = row_inputs(loss_fn, labels, rows, torch.float32, noise_source, True)
    column_ids = loss_fn.column_ids_on(torch.device("cpu"))
    shard = VocabShard(group, start, stop)
    stats = row_stats(
        local_hidden, OutputHead(local_weight), rows, targets, column_ids, shard, payload, "torch"
    )
    out = loss_from_rows(loss_fn, labels, rows, stats, noise, None)
    out.loss.backward()

    for field in FIELDS:
        torch.testing.assert_close(
            getattr(out, field), getattr(expected, field), rtol=1e-6, atol=1e-7, msg=field
        )
    # fp32 sums in another order (the hidden states' gradient is summed over the shards): 1e-5 of each
    # tensor's scale; a wrong row or shard gives differences of its order
    for got, want in (
        (local_hidden.grad, full_hidden.grad),
        (local_weight.grad, full_weight.grad[start:stop]),
    ):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    _assert_same_on_all_ranks(torch.stack([getattr(out, field).detach() for field in FIELDS]), group)


def _traffic(rank, world, group, vocab):
    """Collectives and bytes of one forward+backward at B*T = 32 positions."""
    digit_ids = _digit_ids("spread", vocab, world)
    logits, labels = _make_batch(2, 16, vocab, digit_ids, seed=5, dtype=torch.float32)
    start, stop = _shard_bounds(vocab, world)[rank]
    local = logits[:, :, start:stop].clone().requires_grad_()
    with TrafficCounter() as counter:
        out = NTILLoss(digit_ids, gumbel_noise_scale=0.0)(
            local, labels, process_group=group, vocab_start=start
        )
        out.loss.backward()
    return {"calls": counter.calls, "bytes": counter.bytes}


def _check_group(rank, world, group) -> dict:
    """Every case on a group of `world` ranks; returns the case count and the measured traffic."""
    cases = 0
    for vocab, placement, dtype, noise in itertools.product(
        (1003, 32003), ("one_shard", "spread", "straddle"), (torch.float32, torch.bfloat16), (0.0, 1.0)
    ):
        _run_case(rank, world, group, vocab=vocab, placement=placement, dtype=dtype, noise=noise, seed=cases)
        cases += 1
    common = {"vocab": 1003, "placement": "spread", "dtype": torch.float32, "seed": 1}
    noisy = _run_case(rank, world, group, noise=3.0, **common)
    quiet = _run_case(rank, world, group, noise=0.0, **common)
    assert (noisy.rel.item(), noisy.mag.item()) != (quiet.rel.item(), quiet.mag.item()), "noise had no effect"
    for dtype in (torch.float32, torch.bfloat16):
        _run_case(rank, world, group, vocab=1003, placement="straddle", dtype=dtype, noise=1.0, options=True)
    _run_case(rank, world, group, noise=1.0, all_ignored=True, **{**common, "seed": 2})
    cases += 5
    for vocab, options in ((1003, False), (32003, False), (1003, True)):
        _run_labelled_case(rank, world, group, vocab=vocab, options=options, seed=cases)
        cases += 1
    return {
        "cases": cases,
        "traffic": {vocab: _traffic(rank, world, group, vocab) for vocab in (1003, 32003)},
    }


def _worker(rank, world_sizes, init_file, result_file):
    os.environ["OMP_NUM_THREADS"] = "1"
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
@pytest.mark.timeout(300)
def test_vocab_parallel_loss_equals_unsharded_on_2_3_and_4_ranks(tmp_path):
    world_sizes = (2, 3, 4)
    result_file = tmp_path / "result.json"
    mp.spawn(_worker, args=(world_sizes, str(tmp_path / "rendezvous"), str(result_file)), nprocs=4, join=True)
    results = json.loads(result_file.read_text())
    assert sorted(results) == ["2", "3", "4"]
    for world, result in results.items():
        assert result["cases"] == 32, world
        # Traffic is O(B*T) and independent of V: one MAX all-reduce of N floats and one SUM
        # all-reduce of N * (3 + 10) floats, with N = 32 positions; no other collective; nothing
        # in the backward. An all-gather of the logits would move N * V * 4 bytes per rank.
        positions = 32
        small, large = result["traffic"]["1003"], result["traffic"]["32003"]
        assert small == large, world
        assert small["calls"] == {"all_reduce": 2}, world
        assert small["bytes"] == positions * 4 + positions * (3 + 10) * 4, world
        assert small["bytes"] * 1000 < positions * 32003 * 4, world
