"""Per-GPU memory of a recipe on N GPUs of G GB, and whether it fits (ntil_ds/memory_estimate.py).

    python launch/estimate.py configs/train/qwen2vl_7b_clock.yaml --gpus 8 --gpu-memory-gb 80
    python launch/estimate.py configs/train/qwen3vl_8b_lora_clock.yaml --gpus 2 --gpu-memory-gb 24 \\
        lora.quantize=nf4 deepspeed=configs/deepspeed/zero2.json

    python launch/estimate.py --update-recipes configs/train/*.yaml   # rewrite the recipes' memory lines

key=value overrides work as in launch/train.py. The model's dimensions come from its local config.json,
or from the numbers shipped for the models the recipes name; nothing is downloaded. Exit code 0 when it
fits, 1 when it does not.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ntil_ds.config import ConfigError, load_config
from ntil_ds.ds_config import load_deepspeed_json
from ntil_ds.memory_estimate import GIB, estimate, estimate_as_dict

# The line each GPU recipe carries in its header; --update-recipes rewrites its numbers.
HEADER_LINE = re.compile(r"^# launch/estimate\.py --gpus (\d+) --gpu-memory-gb (\d+):.*$", re.MULTILINE)


def header_line(gpus: int, memory_gb: int, result) -> str:
    verdict = "fits" if result.fits else "does NOT fit"
    return (
        f"# launch/estimate.py --gpus {gpus} --gpu-memory-gb {memory_gb}: {result.total / GIB:.1f} GiB of "
        f"{result.usable / GIB:.1f} GiB per GPU ({verdict})"
    )


def update_recipes(paths: list[str]) -> int:
    """Rewrite every recipe's estimator line with the numbers of the recipe as it is now."""
    for path in paths:
        text = Path(path).read_text()
        match = HEADER_LINE.search(text)
        if not match:
            continue
        gpus, memory = int(match.group(1)), int(match.group(2))
        cfg = load_config(path)
        result = estimate(cfg, load_deepspeed_json(cfg.deepspeed), gpus, memory)
        line = header_line(gpus, memory, result)
        Path(path).write_text(text[: match.start()] + line + text[match.end() :])
        print(f"{path}: {line[2:]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--update-recipes":
        return update_recipes(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipe")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job (all nodes)")
    parser.add_argument(
        "--gpu-memory-gb", type=float, required=True, help="memory of one GPU, GB (1e9 bytes)"
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        result = estimate(cfg, load_deepspeed_json(cfg.deepspeed), args.gpus, args.gpu_memory_gb)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(estimate_as_dict(result), indent=2) if args.json else result.report())
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
