"""What the data cache's key costs at a start (ntil_ds/data/cache.py), against how it was computed before.

    python benchmarks/cache_key.py --weights-mib 2048 --lines 1000000 --ranks 8

- processor: today's `processor_digest` (the processor as loaded: class, modality, what its
  ``save_pretrained`` writes) against the folder walk it replaced (every file of the model folder but
  those with a weight suffix, so a Hub clone's ``.git/lfs/objects`` blobs, the weights, were read), on the
  tiny Qwen2-VL folder with ``--weights-mib`` of blobs under ``.git/lfs/objects`` as a ``git clone`` of a
  Hub repository has them;
- data: the sha256 of a ``--lines`` JSONL file, once (today: the main rank, which shares the key) against
  ``--ranks`` times (before: every rank, each at every start; run here one after another, so the
  concurrent reads of a node's ranks are not modelled: on one disk they cost at least as much).

Seconds are the best of ``--repeat`` runs, in one process (the file pages are in the page cache after
the first: the ratios are the work's, not a cold disk's). Printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

# the suffixes the folder walk skipped (weights saved under their own names)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


def folder_walk_digest(folder: Path) -> str:
    """The processor digest as it was: every file of the folder but weights, in name order."""
    from ntil_ds.data.cache import update_with_file

    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)):
        digest.update(str(file.relative_to(folder)).encode() + b"\0")
        update_with_file(digest, file)
    return digest.hexdigest()


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights-mib", type=int, default=1024)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from ntil_ds.data import load_processor
    from ntil_ds.data.cache import file_digest, processor_digest
    from ntil_ds.tiny import build_tiny_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model_folder("qwen2_vl", Path(tmp) / "model")
        blobs = folder / ".git" / "lfs" / "objects" / "ab" / "cd"
        blobs.mkdir(parents=True)
        chunk = os.urandom(1 << 20)
        for shard in range(max(1, args.weights_mib // 512) if args.weights_mib else 0):
            with (blobs / f"shard{shard}").open("wb") as out:
                for _ in range(min(512, args.weights_mib - 512 * shard)):
                    out.write(chunk)
        processor = load_processor(folder)
        data = Path(tmp) / "train.jsonl"
        with data.open("w") as out:
            for i in range(args.lines):
                turns = [{"role": "user", "content": f"What is {i} + {2 * i}?"},
                         {"role": "assistant", "content": str(3 * i)}]  # fmt: skip
                out.write(json.dumps({"messages": turns}) + "\n")
        size_mib = data.stat().st_size / 2**20
        walk = best(lambda: folder_walk_digest(folder), args.repeat)
        loaded = best(lambda: processor_digest(processor), args.repeat)
        once = best(lambda: file_digest(data), args.repeat)
    print("| part | before | s | today | s | today / before |")
    print("|---|---|---:|---|---:|---:|")
    print(f"| processor digest | folder walk ({args.weights_mib} MiB under .git/lfs) | {walk:.3f} | "
          f"as loaded | {loaded:.3f} | {loaded / walk:.4f} |")  # fmt: skip
    print(f"| data sha256, one node's start | {args.ranks} ranks x {size_mib:.0f} MiB | {once * args.ranks:.3f} | "
          f"main rank x {size_mib:.0f} MiB | {once:.3f} | {1 / args.ranks:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
