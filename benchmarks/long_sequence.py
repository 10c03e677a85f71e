"""Per-rank activation peak and step time against sequence length, without and with Ulysses sequence
parallelism (parallel.sequence_parallel_size), NTIL on the rows.

    python benchmarks/long_sequence.py                                  # CPU: 2k-32k tokens, SP=1 and 2
    python benchmarks/long_sequence.py --device cuda --lengths 16384,32768,65536,131072 --sp 1,2,4 \\
        --hidden 2048 --layers 8 --heads 16                             # the GPU command (one node)
    python benchmarks/long_sequence.py --model qwen2_vl --lengths 2048,4096,8192,16384   # many images a row
    python benchmarks/long_sequence.py --model qwen2_vl --device cuda --lengths 16384,32768,65536 \\
        --sp 1,2,4 --hidden 2048 --layers 8 --heads 16 --vision-depth 8  # the multimodal GPU command

Each (length, size) point is one torchrun job of ``size`` processes (this file with ``--worker``) that
builds the same small Qwen2 model (random weights, float32 on CPU and bf16 on CUDA, sdpa), one row of
``length`` tokens whose labels are numbers throughout, and takes forward + backward through the path the
trainer takes: ``MicroBatch.slice_sequence`` to each rank's slice, DeepSpeed's Ulysses attention
(``engine.register_sequence_parallel``), NTILLoss over the group (``loss.sequence_shards``). With
``--model qwen2_vl`` the model is a Qwen2-VL of the same text size and a ``--vision-depth`` tower, and a
quarter of the row is images (224 x 224 pixels, 64 tokens each, spread along it): every rank runs the
tower on its share of them (the features all-gathered) and its language model takes its slice of the
merged row (``model.sequence_parallel.slice_after_merge``); the tower's forward time is reported apart;
``--freeze-vision`` leaves the tower untrained (``model.freeze_vision_tower``). No optimizer,
no ZeRO: the weights and their gradients are the same on every rank and in every job, so what differs is
the activations. Peak: the most memory the step held above what it held before it, the largest of the
ranks (CUDA: ``max_memory_allocated``; CPU: the resident set sampled every millisecond by a thread).
Time: the median of ``--repeat`` steps after one warm-up step, the slowest rank. The table prints the
SP=1 value beside each size's and their ratio; ``--results FILE`` writes the points as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class PeakSampler:
    """The largest resident set of this process while open, sampled every millisecond (CPU)."""

    def __init__(self) -> None:
        import psutil

        self.process, self.peak, self.running = psutil.Process(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self.start = self.process.memory_info().rss
        self.peak = self.start
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2VLForConditionalGeneration

    from ntil_ds.config import load_config
    from ntil_ds.constants import IGNORE_INDEX
    from ntil_ds.data.batch import MicroBatch
    from ntil_ds.engine import init_distributed, register_sequence_parallel
    from ntil_ds.loss import NTILLoss, digit_token_ids_from_tokenizer
    from ntil_ds.loss.sequence_shards import AllGatherInGroup, SequenceShard
    from ntil_ds.model.sequence_parallel import slice_after_merge
    from ntil_ds.tiny import build_tiny_model_folder

    init_distributed()
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else None
    device = device or torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model_folder("qwen2", Path(folder) / "m"))
    text = dict(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=max(args.length, 4096), tie_word_embeddings=False,
    )  # fmt: skip
    vl = args.model == "qwen2_vl"
    config = vl_config(text, args.vision_depth) if vl else Qwen2Config(**text)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = (Qwen2VLForConditionalGeneration if vl else Qwen2ForCausalLM)(config).to(device, dtype).train()
    if vl and args.freeze_vision:  # as model.freeze_vision_tower: the tower keeps nothing for backward
        model.model.visual.requires_grad_(False)
    cfg = load_config(
        REPO_ROOT / "configs/train/tiny_qwen2vl_clock.yaml",
        [f"parallel.sequence_parallel_size={size}", "model.kind=llm", "train.micro_batch_size=1"],
    )
    group = None
    if size > 1:
        group = register_sequence_parallel(model, cfg, {}).get_sequence_parallel_group()

    digits = digit_token_ids_from_tokenizer(tokenizer)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, len(tokenizer) - 3, (1, args.length), generator=generator)  # not image ids
    input_ids[:, 1::2] = torch.tensor(digits)[torch.randint(0, 10, (args.length // 2,), generator=generator)]
    images = add_images(input_ids, config, generator) if vl else {}
    targets = torch.cat([input_ids[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    targets[targets == getattr(config, "image_token_id", -1)] = IGNORE_INDEX
    whole = MicroBatch([0], {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                             "targets": targets, **images})  # fmt: skip
    batch = whole.slice_sequence(rank, size, whole_rows=vl) if size > 1 else whole
    loss_fn = NTILLoss(digits)
    sequence = SequenceShard(group, batch.sequence) if size > 1 else None
    inputs = batch.model_inputs(device, dtype)
    inputs.pop("attention_mask", None)  # as the sliced rows: causal attention by positions alone
    if size == 1 and not vl:
        inputs["position_ids"] = torch.arange(args.length, device=device)[None]
    vision_times = []
    if vl:  # the tower's forward, timed apart: every rank of a group runs it on all the row's images
        model.model.visual.register_forward_pre_hook(lambda *_: vision_times.append(-time.perf_counter()))
        model.model.visual.register_forward_hook(lambda *_: vision_times.append(time.perf_counter()))

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        started = time.perf_counter()
        with (
            slice_after_merge(model, batch.sequence, group, AllGatherInGroup.apply)
            if vl and size > 1
            else nullcontext()
        ):
            logits = model(**inputs, use_cache=False).logits
        out = loss_fn(logits, batch.targets.to(device), generator=torch.Generator(device).manual_seed(2),
                      sequence=sequence)  # fmt: skip
        out.loss_sum.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    step()  # warm-up: kernels chosen, gradients allocated (they count in no point's peak)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        times = [step() for _ in range(args.repeat)]
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    else:
        with PeakSampler() as sampler:
            times = [step() for _ in range(args.repeat)]
        peak = sampler.growth_mib
    vision_s = sum(vision_times[-2 * args.repeat :]) / args.repeat if vl else 0.0
    point = {"time_s": statistics.median(times), "peak_mib": peak, "vision_s": vision_s}
    points = [None] * size
    dist.all_gather_object(points, point)
    if rank == 0:
        result = {
            "length": args.length,
            "sp": size,
            "time_s": max(p["time_s"] for p in points),
            "peak_mib": max(p["peak_mib"] for p in points),
            "vision_s": max(p["vision_s"] for p in points),
        }
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


IMAGE_SIDE_PATCHES = 16  # 224 x 224 pixels in 14-pixel patches: 256 patches, 64 tokens after the 2x2 merge


def vl_config(text: dict, vision_depth: int):
    """A Qwen2-VL config with ``text`` as its language model and a ``vision_depth``-block tower."""
    from transformers import Qwen2VLConfig

    head_dim = text["hidden_size"] // text["num_attention_heads"]
    quarter = head_dim // 8  # mrope sections (temporal, height, width) sum to head_dim / 2
    text = dict(text, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                       "mrope_section": [2 * quarter, quarter, quarter]})  # fmt: skip
    vision = {"depth": vision_depth, "embed_dim": text["hidden_size"], "hidden_size": text["hidden_size"],
              "num_heads": max(1, text["hidden_size"] // 64), "mlp_ratio": 4, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
    ids = {"image_token_id": text["vocab_size"] - 3, "vision_start_token_id": text["vocab_size"] - 2,
           "vision_end_token_id": text["vocab_size"] - 1}  # fmt: skip
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def add_images(input_ids, config, generator) -> dict:
    """Images over a quarter of the row (64 tokens each, evenly spread), written into ``input_ids``;
    their random pixels and grids."""
    import torch

    side = IMAGE_SIDE_PATCHES
    tokens = side * side // 4
    count = max(1, input_ids.shape[1] // 4 // (tokens + 2))
    stride = input_ids.shape[1] // count
    for k in range(count):
        start = k * stride + 1
        input_ids[0, start] = config.vision_start_token_id
        input_ids[0, start + 1 : start + 1 + tokens] = config.image_token_id
        input_ids[0, start + 1 + tokens] = config.vision_end_token_id
    patch = 3 * 2 * 14 * 14  # channels x temporal patch x 14 x 14
    pixels = torch.randn(count * side * side, patch, generator=generator)
    return {
        "pixel_values": pixels,
        "image_grid_thw": torch.tensor([[1, side, side]] * count),
        "mm_token_type_ids": (input_ids == config.image_token_id).int(),  # 1: image, as the processor marks
    }


def run_point(args: argparse.Namespace, length: int, size: int) -> dict:
    from ntil_ds.jobs import job_env, launcher_command

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "point.json"
        worker_args = ["--worker", "--out", str(out), "--length", str(length), "--device", args.device,
                       "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
                       "--repeat", str(args.repeat), "--model", args.model,
                       "--vision-depth", str(args.vision_depth),
                       *(["--freeze-vision"] if args.freeze_vision else [])]  # fmt: skip
        command = launcher_command("torchrun", size, Path(__file__), worker_args)
        env = job_env(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // size)))
        if args.device == "cpu":
            # glibc serves large blocks by mmap and gives them back at free, so the resident set follows
            # what is alive (its default threshold rises to 32 MiB after the first frees: a freed
            # activation would stay resident and hide the next step's peak).
            env.update(DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536")
        job = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if job.returncode != 0:
            raise SystemExit(f"length {length}, SP={size} failed:\n{(job.stdout + job.stderr)[-4000:]}")
        return json.loads(out.read_text())


def table(points: list[dict], sizes: list[int]) -> str:
    by = {(p["length"], p["sp"]): p for p in points}
    vision = any(p.get("vision_s") for p in points)  # the tower's forward, part of the step
    head = ["tokens"]
    for size in sizes:
        head += [f"peak MiB/rank SP={size}", f"step s SP={size}"] + ([f"tower s SP={size}"] if vision else [])
        if size != sizes[0]:
            head += [f"peak ratio SP={size}/{sizes[0]}", f"time ratio SP={size}/{sizes[0]}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for length in sorted({p["length"] for p in points}):
        base = by[(length, sizes[0])]
        row = [str(length)]
        for size in sizes:
            p = by[(length, size)]
            row += [f"{p['peak_mib']:.0f}", f"{p['time_s']:.2f}"] + (
                [f"{p['vision_s']:.2f}"] if vision else []
            )
            if size != sizes[0]:
                row += [f"{p['peak_mib'] / base['peak_mib']:.2f}", f"{p['time_s'] / base['time_s']:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--sp", default="1,2", help="sequence-parallel sizes (processes per job); 1 first")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--model", choices=["qwen2", "qwen2_vl"], default="qwen2")
    parser.add_argument("--vision-depth", type=int, default=2, help="qwen2_vl: the vision tower's blocks")
    parser.add_argument("--freeze-vision", action="store_true", help="qwen2_vl: the tower not trained")
    parser.add_argument("--results", default="", help="write the points here as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sizes = [int(s) for s in args.sp.split(",")]
    points = []
    for length in (int(n) for n in args.lengths.split(",")):
        for size in sizes:
            points.append(run_point(args, length, size))
            print(f"{length} tokens, SP={size}: {points[-1]}", file=sys.stderr, flush=True)
            if args.results:
                Path(args.results).write_text(json.dumps(points, indent=1))
    print(table(points, sizes))


if __name__ == "__main__":
    main()
