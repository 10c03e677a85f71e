"""Start-up time and resident memory of the dataset on 2 ranks: today's path (every rank reads and encodes
every line at every start, ``data.cache=false``) against the data cache (ntil_ds/data/cache.py: the first
start encodes once, split over the ranks, ntil_ds/data/parallel_build.py; later starts map).

    python benchmarks/data_scale.py --lines 10000 100000 --kinds text images

For each size and kind (arithmetic text lines with the tiny Qwen2 tokenizer; lines with 1-2 image paths
with the tiny Qwen2-VL processor), each start runs as 2 fresh processes joined by gloo, calling
``load_dataset`` as the trainer does; a start's seconds are the slower rank's; memory is the growth of
each rank's resident memory while loading, split into private memory (RssAnon: what each rank and
loader worker holds for itself) and mapped file pages (RssFile: the page cache, shared by every process
of the machine that maps the same cache). Printed as a Markdown table with the ratios new / today.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_lines(path: Path, n: int, images: bool = False, seed: int = 0) -> Path:
    rng = random.Random(seed)
    if images:
        from PIL import Image

        for i, size in enumerate([(32, 32), (48, 32), (64, 48)]):
            Image.new("RGB", size, (40 * i, 100, 200)).save(path.parent / f"img{i}.png")
    with path.open("w") as out:
        for i in range(n):
            a, b = rng.randint(10, 99_999), rng.randint(10, 99_999)
            question = f"What is {a} + {b}?"
            if images:
                parts = [{"type": "image", "image": f"img{(i + k) % 3}.png"} for k in range(1 + i % 2)]
                question = [*parts, {"type": "text", "text": question}]
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": str(a + b)},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def rss_mib() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) / 1024
    return fields


def rank_main(rank: int, mode: str, data: Path, model: Path, cache_dir: Path, store: Path) -> dict:
    """One rank of one start: load the dataset as the trainer does, then plan from every sample's length."""
    from datetime import timedelta

    import torch.distributed as dist

    from ntil_ds.data import load_processor
    from ntil_ds.data.cached_dataset import load_dataset
    from ntil_ds.dist import broadcast_from_main

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(hours=2))  # fmt: skip
    processor = load_processor(model)
    dist.barrier()
    before = rss_mib()
    started = time.perf_counter()
    dataset = load_dataset(data, processor, 256, "error", cache=mode != "today", cache_dir=cache_dir,
                           is_main=rank == 0, share=broadcast_from_main, ranks=2 if mode == "new" else 1)  # fmt: skip
    seconds = time.perf_counter() - started
    lengths = (
        dataset.lengths()
        if hasattr(dataset, "lengths")
        else [dataset.num_tokens(i) for i in range(len(dataset))]
    )
    tokens = int(sum(lengths))  # what packing reads
    after = rss_mib()
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "status": getattr(dataset, "cache_status", "encoded"), "seconds": seconds,
            "tokens": tokens, "anon_mib": after["RssAnon"] - before["RssAnon"],
            "file_mib": after["RssFile"] - before["RssFile"]}  # fmt: skip


def start(mode: str, data: Path, model: Path, cache_dir: Path) -> dict:
    """One start on 2 ranks: the slower rank's seconds, the larger rank's memory."""
    store = Path(tempfile.mkdtemp()) / "store"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(r),
                mode,
                str(data),
                str(model),
                str(cache_dir),
                str(store),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    out = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return {
        "status": out[0]["status"],
        "seconds": max(o["seconds"] for o in out),
        "tokens": out[0]["tokens"],
        "anon_mib": max(o["anon_mib"] for o in out),
        "file_mib": max(o["file_mib"] for o in out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--kinds", nargs="+", choices=["text", "images"], default=["text", "images"])
    parser.add_argument(
        "--today-max", type=int, default=10**9, help="skip today's path above this many lines"
    )
    parser.add_argument("--rank", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank, mode, data, model, cache_dir, store = args.rank
        print(json.dumps(rank_main(int(rank), mode, Path(data), Path(model), Path(cache_dir), Path(store))))
        return

    from ntil_ds.tiny import build_tiny_model_folder

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {"text": build_tiny_model_folder("qwen2", root / "qwen2"),
                  "images": build_tiny_model_folder("qwen2_vl", root / "qwen2_vl")}  # fmt: skip
        for kind in args.kinds:
            for n in args.lines:
                folder = root / f"{kind}_{n}"
                folder.mkdir()
                data = write_lines(folder / "train.jsonl", n, images=kind == "images")
                today = start("today", data, models[kind], folder / "c0") if n <= args.today_max else None
                serial = start("serial", data, models[kind], folder / "c1")  # the cache before: rank 0 alone
                first = start("new", data, models[kind], folder / "c2")
                again = start("new", data, models[kind], folder / "c2")
                assert (serial["status"], first["status"], again["status"]) == ("built", "built", "reused")
                assert serial["tokens"] == first["tokens"] == again["tokens"] == (today or first)["tokens"]
                rows.append((kind, n, today, serial, first, again))
                print(kind, n, today, serial, first, again, file=sys.stderr, flush=True)
    print("| kind | lines | today: start s | cached, rank 0 alone: first s | new: first s | first / today "
          "| first / rank-0-alone | new: cached start s | cached / today | today: private MiB/rank "
          "| new cached: private MiB/rank | mapped MiB | private new / today |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, n, today, serial, first, again in rows:
        t = today or {"seconds": float("nan"), "anon_mib": float("nan")}
        print(
            f"| {kind} | {n:,} | {t['seconds']:.2f} | {serial['seconds']:.2f} | {first['seconds']:.2f} "
            f"| {first['seconds'] / t['seconds']:.2f} | {first['seconds'] / serial['seconds']:.2f} "
            f"| {again['seconds']:.3f} | {again['seconds'] / t['seconds']:.4f} | {t['anon_mib']:.1f} "
            f"| {again['anon_mib']:.1f} | {again['file_mib']:.1f} | {again['anon_mib'] / t['anon_mib']:.3f} |"
        )


if __name__ == "__main__":
    main()
