"""Vocab-parallel GroupedNTILLoss on 2 and 3 gloo processes equals the unsharded loss on the full logits.

The grouped loss gathers the number token table's 1,110 columns through the same stage 1 as NTILLoss, so
its shards must give the same loss, parts and slice gradients: number ids spread over every shard
(shuffled) and all in the last shard, uneven shards, Gumbel noise off and on (the first rank's noise,
2,000 columns per position, travels in the SUM all-reduce), the signed/decimal options, and the labelled
head on the head's shard. The unsharded loss itself is checked against the float64 reference in
tests/unit/test_loss_grouped.py.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntil_ds.labelled_forward import loss_from_rows, row_inputs, row_stats
from ntil_ds.loss.grouped import GroupedNTILLoss
from ntil_ds.loss.labelled_head import OutputHead
from ntil_ds.model.tensor_parallel import VocabShard
from tests.distributed.test_vocab_parallel import _assert_same_on_all_ranks, _shard_bounds
from tests.unit.test_loss_grouped import OTHERS, SIGNED_DECIMAL, TABLE, VOCAB, grouped_batch

FIELDS = ("loss", "ntil", "emd", "rel", "mag", "ce_mean", "ce_sum")
LAST_SHARD_VOCAB = 4003  # 3 ranks: 1335/1334/1334; ids 2893.. are the table, all on the last rank
LAST_SHARD_TABLE = {1: list(range(2893, 2903)), 2: list(range(2903, 3003)), 3: list(range(3003, 4003))}


def _run_case(rank, world, group, *, table, vocab, noise, options, seed):
    loss_fn = GroupedNTILLoss(table, kernel="torch", gumbel_noise_scale=noise, **options)
    logits, labels = grouped_batch(
        3, 20, seed=seed, table=table, vocab=vocab, dtype=torch.float32, others=OTHERS
    )
    full = logits.clone().requires_grad_()
    expected = loss_fn(full, labels, generator=torch.Generator().manual_seed(1234))
    expected.loss.backward()
    start, stop = _shard_bounds(vocab, world)[rank]
    local = logits[:, :, start:stop].clone().requires_grad_()
    generator = torch.Generator().manual_seed(1234 if rank == 0 else 99 + rank)  # only rank 0's counts
    out = loss_fn(local, labels, process_group=group, vocab_start=start, generator=generator)
    out.loss.backward()
    for field in FIELDS:
        torch.testing.assert_close(
            getattr(out, field), getattr(expected, field), rtol=1e-6, atol=1e-7, msg=field
        )
    torch.testing.assert_close(local.grad, full.grad[:, :, start:stop], rtol=1e-5, atol=1e-9)
    _assert_same_on_all_ranks(torch.stack([getattr(out, field).detach() for field in FIELDS]), group)
    assert expected.rel > 0 and expected.emd > 0


def _run_labelled_case(rank, world, group, *, seed, hidden_size=16):
    loss_fn = GroupedNTILLoss(TABLE, kernel="torch", gumbel_noise_scale=1.0, **SIGNED_DECIMAL)
    _, labels = grouped_batch(2, 20, seed=seed, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 20, hidden_size, generator=generator)
    weight = torch.randn(VOCAB, hidden_size, generator=generator) * 0.5
    full_hidden, full_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = loss_fn(full_hidden @ full_weight.t(), labels, generator=torch.Generator().manual_seed(1234))
    expected.loss.backward()
    start, stop = _shard_bounds(VOCAB, world)[rank]
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
    for got, want in (
        (local_hidden.grad, full_hidden.grad),
        (local_weight.grad, full_weight.grad[start:stop]),
    ):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def _check_group(rank, world, group) -> int:
    cases = 0
    for table, vocab in ((TABLE, VOCAB), (LAST_SHARD_TABLE, LAST_SHARD_VOCAB)):
        for noise, options in ((0.0, {}), (1.0, {}), (1.0, SIGNED_DECIMAL)):
            _run_case(rank, world, group, table=table, vocab=vocab, noise=noise, options=options, seed=cases)
            cases += 1
    _run_labelled_case(rank, world, group, seed=cases)
    return cases + 1


def _worker(rank, world_sizes, init_file, result_file):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=max(world_sizes))
    try:
        results = {}
        for world in world_sizes:
            group = dist.new_group(list(range(world)))
            if rank < world:
                results[world] = _check_group(rank, world, group)
        if rank == 0:
            Path(result_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_vocab_parallel_grouped_loss_equals_unsharded_on_2_and_3_ranks(tmp_path):
    result_file = tmp_path / "result.json"
    mp.spawn(_worker, args=((2, 3), str(tmp_path / "rendezvous"), str(result_file)), nprocs=3, join=True)
    assert json.loads(result_file.read_text()) == {"2": 7, "3": 7}
