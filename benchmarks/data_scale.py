"""Start-up time and resident memory of the dataset: today's path (every start encodes every line) against
the data cache (ntil_ds/data/cache.py: the first start encodes and writes, later starts map).

    python benchmarks/data_scale.py --lines 10000 100000

For each size, generated arithmetic lines (text) are written, then each measurement runs in a fresh
process (one rank) so its memory is its own: the seconds to construct the dataset, and the growth of the
process's resident memory it caused, split into private memory (RssAnon: what each rank and loader
worker holds for itself) and mapped file pages (RssFile: the page cache, shared by every process of the
machine that maps the same cache). Printed as a Markdown table with the ratios cached / today.
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


def write_lines(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(n):
            a, b = rng.randint(10, 99_999), rng.randint(10, 99_999)
            messages = [
                {"role": "user", "content": f"What is {a} + {b}?"},
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


def child(mode: str, data: Path, model: Path, cache_dir: Path) -> dict:
    """One start in this process: construct the dataset, then plan from every sample's length."""
    from ntil_ds.data import ConversationDataset, load_processor
    from ntil_ds.data.cached_dataset import CachedConversationDataset

    processor = load_processor(model)
    before = rss_mib()
    started = time.perf_counter()
    if mode == "today":
        dataset = ConversationDataset(data, processor, max_seq_len=256)
        status = "encoded"
    else:
        dataset = CachedConversationDataset(data, processor, max_seq_len=256, cache_dir=cache_dir)
        status = dataset.cache_status
    seconds = time.perf_counter() - started
    tokens = sum(dataset.num_tokens(i) for i in range(len(dataset)))  # what packing reads
    after = rss_mib()
    return {
        "mode": mode,
        "status": status,
        "seconds": seconds,
        "samples": len(dataset),
        "tokens": tokens,
        "anon_mib": after["RssAnon"] - before["RssAnon"],
        "file_mib": after["RssFile"] - before["RssFile"],
    }


def run_child(mode: str, data: Path, model: Path, cache_dir: Path) -> dict:
    command = [sys.executable, __file__, "--child", mode, str(data), str(model), str(cache_dir)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument(
        "--child", nargs=4, metavar=("MODE", "DATA", "MODEL", "CACHE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        mode, data, model, cache_dir = args.child
        print(json.dumps(child(mode, Path(data), Path(model), Path(cache_dir))))
        return

    from ntil_ds.tiny import build_tiny_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model_folder("qwen2", root / "model")
        rows = []
        for n in args.lines:
            data = write_lines(root / f"lines_{n}.jsonl", n)
            cache = root / f"cache_{n}"
            today = run_child("today", data, model, cache)
            first = run_child("cached", data, model, cache)
            again = run_child("cached", data, model, cache)
            assert (first["status"], again["status"]) == ("built", "reused"), (first, again)
            assert today["tokens"] == first["tokens"] == again["tokens"]
            rows.append((n, today, first, again))
    print("| lines | today: start s | cached: first start s | first / today | cached: later start s "
          "| later / today | today: private MiB | cached: private MiB | cached: mapped MiB "
          "| private cached / today |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, today, first, again in rows:
        print(
            f"| {n:,} | {today['seconds']:.2f} | {first['seconds']:.2f} | {first['seconds'] / today['seconds']:.2f} "
            f"| {again['seconds']:.3f} "
            f"| {again['seconds'] / today['seconds']:.3f} | {today['anon_mib']:.1f} | {again['anon_mib']:.1f} "
            f"| {again['file_mib']:.1f} | {again['anon_mib'] / max(today['anon_mib'], 1e-9):.3f} |"
        )


if __name__ == "__main__":
    main()
