"""NTIL on rows split over a sequence-parallel group equals NTIL on the whole rows, on 2 and 3 gloo
processes (3 splits the 13-token rows unevenly: they are padded to 15).

Every row carries numbers whose digits (or grouped-digit tokens) straddle the slice boundaries, so each
sequence-level term (REL/MAG of the whole number) and each EMD place weight needs digits held by another
rank. Each rank compares, in float64: the group's summed shares of the loss and CE with the whole rows'
loss_sum and ce_sum, the reported NTIL parts, and the gradient of its own slice of the logits with the
same slice of the one-process gradient. The Gumbel noise comes from a generator in the same state on
every rank and in the reference, and must give the same loss: it may not depend on the group's size.
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntil_ds.dist import SequenceSlice
from ntil_ds.loss import NTILLoss
from ntil_ds.loss.grouped import GroupedNTILLoss
from ntil_ds.loss.sequence_shards import SequenceShard

DIGITS = list(range(10, 20))
TABLE = {1: DIGITS, 2: list(range(100, 200)), 3: list(range(200, 1200))}
VOCAB = 1210
WORDS = [3, 4, 5, 6]
PARTS = ("ntil", "emd", "rel", "mag")


def _labels(grouped: bool) -> torch.Tensor:
    """Two rows of 13 aligned labels: words, ignored positions and numbers across positions 4-10 (the
    boundaries are after 7 for 2 ranks, after 5 and 10 for 3)."""
    if grouped:  # "12" "345" | "6" ... tokens of widths 2, 3, 1 make one number
        rows = [
            [-100, -100, 3, 4, 111, 545, 16, 5, 6, 1199, 17, 3, -100],
            [-100, 3, 4, 5, 12, 100, 200, 6, 3, 150, 150, 18, 4],
        ]
    else:
        rows = [
            [-100, -100, 3, 4, 11, 12, 13, 14, 15, 16, 17, 3, -100],
            [-100, 3, 4, 5, 19, 10, 18, 6, 13, 13, 13, 13, 4],
        ]
    return torch.tensor(rows)


def _loss(grouped: bool, options: dict) -> NTILLoss:
    if grouped:
        return GroupedNTILLoss(TABLE, kernel="torch", number_stage="eager", **options)
    return NTILLoss(DIGITS, kernel="torch", number_stage="eager", **options)


CASES = [
    (False, {}),  # paper mode, Gumbel noise on
    (False, {"ntil_ratio": "sample", "gumbel_noise_scale": 0.3}),
    (False, {"abs_alpha": 0.0, "mag_alpha": 0.0}),  # EMD alone: no noise drawn
    (True, {}),
    (True, {"ntil_ratio": "sample", "gumbel_noise_scale": 0.3}),
]


def _run_case(rank: int, size: int, group, grouped: bool, options: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    labels = _labels(grouped)
    logits = torch.randn(*labels.shape, VOCAB, dtype=torch.float64) * 3
    loss_fn = _loss(grouped, options)

    reference_logits = logits.clone().requires_grad_(True)
    reference = loss_fn(reference_logits, labels, generator=torch.Generator().manual_seed(seed))
    reference.loss_sum.backward()

    shard = SequenceShard(group, SequenceSlice.of(labels.shape[1], rank, size))
    local_logits = shard.local_part(logits).clone().requires_grad_(True)
    local_labels = shard.local_part(labels - (-100)) + (-100)  # the padding is ignored (-100)
    out = loss_fn(local_logits, local_labels, generator=torch.Generator().manual_seed(seed), sequence=shard)
    out.loss_sum.backward()
    sums = torch.stack([out.loss_sum.detach(), out.ce_sum.detach(), out.num_tokens.double()])
    dist.all_reduce(sums, group=group)

    expected_grad = shard.local_part(reference_logits.grad)

    def rel(a, b) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))

    return {
        "loss_sum": rel(sums[0], reference.loss_sum.detach()),
        "ce_sum": rel(sums[1], reference.ce_sum.detach()),
        "num_tokens": [int(sums[2]), int(reference.num_tokens)],
        **{part: rel(getattr(out, part).detach(), getattr(reference, part).detach()) for part in PARTS},
        "grad": rel(local_logits.grad, expected_grad),
        "grad_norm": float(expected_grad.norm()),
        "rel_nonzero": float(reference.rel),
    }


def _worker(rank: int, init_file: str, result_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3)
    results = {}
    for size in (2, 3):
        group = dist.new_group(list(range(size)))  # every rank creates every group
        if rank >= size:
            continue
        for index, (grouped, options) in enumerate(CASES):
            results[f"{size}/{index}"] = _run_case(rank, size, group, grouped, options, seed=index)
    all_results = [None] * 3
    dist.all_gather_object(all_results, results)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(all_results, f)
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ntil_over_sequence_shards_equals_the_whole_rows_on_2_and_3_ranks(tmp_path):
    result_file = tmp_path / "result.json"
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(result_file)), nprocs=3, join=True)
    per_rank = json.loads(result_file.read_text())
    checked = 0
    for rank, results in enumerate(per_rank):
        for case, r in results.items():
            where = f"rank {rank}, size/case {case}: {r}"
            assert r["num_tokens"][0] == r["num_tokens"][1], where
            for field in ("loss_sum", "ce_sum", *PARTS, "grad"):
                assert r[field] < 1e-12, where
            assert r["grad_norm"] > 0 and r["rel_nonzero"] > 0, where  # the checks compare something
            checked += 1
    assert checked == 2 * len(CASES) + 3 * len(CASES)
