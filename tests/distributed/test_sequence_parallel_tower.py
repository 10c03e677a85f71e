"""The vision tower split over a sequence-parallel group (``_tower_on_share``, inside ``slice_after_merge``)
equals the whole tower on one process, on 2 and 3 gloo processes, float64: the merged features of every
image, and the tower's gradient summed over the group (each rank's loss is its share of the whole, as in
training). Images of three sizes (shares balanced by patches), and a single image, which leaves ranks with
none: they run the first image times zero, so ZeRO-3's collectives would stay matched."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRIDS = {"three sizes": [[1, 4, 4], [1, 8, 4], [1, 4, 8]], "one image": [[1, 8, 8]]}


def _tower():
    import tempfile
    from pathlib import Path

    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    from ntil_ds.tiny import build_tiny_model_folder

    with tempfile.TemporaryDirectory() as folder:
        config = AutoConfig.from_pretrained(build_tiny_model_folder("qwen2_vl", Path(folder) / "m"))
    config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).model.visual.double()


def _worker(rank: int, init_file: str, result_file: str) -> None:
    from ntil_ds.loss.sequence_shards import AllGatherInGroup
    from ntil_ds.model.sequence_parallel import _tower_on_share

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3)
    tower, results = _tower(), {}
    for size in (2, 3):
        group = dist.new_group(list(range(size)))  # every rank creates every group
        if rank >= size:
            continue
        for name, grid in GRIDS.items():
            grid_thw = torch.tensor(grid)
            generator = torch.Generator().manual_seed(1)
            pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14, generator=generator).double()
            weights = torch.randn(int(grid_thw.prod(-1).sum()) // 4, 64, generator=generator).double()

            tower.zero_grad()
            whole = tower(pixels, grid_thw=grid_thw).pooler_output
            (whole * weights).sum().backward()
            want = {n: p.grad.clone() for n, p in tower.named_parameters()}

            tower.zero_grad()
            split = _tower_on_share(
                tower.forward,
                tower.spatial_merge_size,
                group,
                AllGatherInGroup.apply,
                pixels,
                grid_thw=grid_thw,
            )
            ((split.pooler_output * weights).sum() / size).backward()  # this rank's share of the loss
            got = {n: p.grad.clone() for n, p in tower.named_parameters()}
            for grad in got.values():
                dist.all_reduce(grad, group=group)
            results[f"{size}/{name}"] = {
                "features": (split.pooler_output - whole).abs().max().item(),
                "grad": max((got[n] - want[n]).abs().max().item() for n in want),
                "grad_scale": max(g.abs().max().item() for g in want.values()),
            }
    gathered = [None] * 3
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_vision_tower_split_over_the_group_equals_the_whole_tower(tmp_path):
    result_file = tmp_path / "result.json"
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(result_file)), nprocs=3, join=True)
    checked = 0
    for rank, results in enumerate(json.loads(result_file.read_text())):
        for case, r in results.items():
            where = f"rank {rank}, {case}: {r}"
            assert r["features"] < 1e-12 and r["grad_scale"] > 0, where
            assert r["grad"] <= 1e-10 * r["grad_scale"], where
            checked += 1
    assert checked == 2 * len(GRIDS) + 3 * len(GRIDS)
