"""Write a tiny offline Hugging Face model folder (config, tokenizer, processor; no weights).

    python launch/make_tiny_model.py qwen2_vl --out models/tiny-qwen2-vl

Train it from random weights with `model.name_or_path=<out> model.init=random`.
"""

from __future__ import annotations

import argparse

from ntil_ds.tiny import TINY_KINDS, TINY_SIZES, build_tiny_model_folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("kind", choices=TINY_KINDS)
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument(
        "--size", choices=list(TINY_SIZES), default="tiny", help="small: learns the easy tasks"
    )
    args = parser.parse_args()
    folder = build_tiny_model_folder(args.kind, args.out, size=args.size)
    print(f"wrote tiny {args.kind} model folder: {folder}")


if __name__ == "__main__":
    main()
