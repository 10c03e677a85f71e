"""The files of a Hub processor folder, written without building the processor.

transformers 5.24's processor classes with a video slot (Qwen-VL, InternVL, SmolVLM) cannot be built
without torchvision (their video processor needs it), and CPU torch 2.13 has none; the files load with
``AutoProcessor`` where torchvision exists and with ``ntil_ds.data.load_processor`` everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path


def save_processor_files(
    out_dir: Path, tokenizer, image_processor, processor_config: dict, video_config: dict
) -> None:
    """Tokenizer, image processor, chat template, processor settings, video processor settings."""
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)
    (out_dir / "processor_config.json").write_text(json.dumps(processor_config, indent=2))
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=2))
