"""`ConversationDataset`: a JSONL file checked and measured at the start, encoded sample by sample."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from PIL import Image

from ntil_ds.data.encoding import EncodedConversation, aligned_targets, encode
from ntil_ds.data.processor import is_multimodal
from ntil_ds.data.progress import progress
from ntil_ds.data.records import BadSample, Conversation, DataError, open_image
from ntil_ds.data.sources import open_source

log = logging.getLogger(__name__)

# Processor outputs with one value per token (batch dim first); every other output is per image.
PER_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
# Per-token tensors with more dimensions: [T, images, tiles] (Llama 3.2 Vision's cross-attention mask:
# which image tiles each token reads). Cut and padded along the tokens as the per-token keys are.
PER_TOKEN_IMAGE_KEYS = ("cross_attention_mask",)


@dataclass
class DataReport:
    """What happened to each line of a data file: kept, cut, or skipped (with the reasons)."""

    path: str
    kept: int = 0
    truncated: int = 0  # kept, with text after max_seq_len (and any answer it cut) left out
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    examples: list[str] = field(default_factory=list)  # the first few skip messages, for the log

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.skipped.items())) or "none"
        return (
            f"{self.path}: {self.kept} samples kept ({self.truncated} truncated), "
            f"{self.num_skipped} skipped ({reasons})"
        )


class ConversationDataset(torch.utils.data.Dataset):
    """Conversations from a JSONL file (see `ntil_ds.data.records`), ready for `Collator`.

    Every line is read, checked (images opened) and measured in tokens here, so a bad line fails at the
    start with its file and line, or with `on_bad_sample="skip"` is skipped and counted in
    `self.report` (logged as a warning when anything was skipped). `dataset[i]` runs the processor: a
    dict of tensors (no batch dimension on per-token ones) plus `targets`, the labels already aligned
    with the model's outputs (`ntil_ds.data.encoding.aligned_targets`).
    """

    def __init__(
        self,
        path: str | Path,
        processor,
        max_seq_len: int = 2048,
        on_bad_sample: Literal["error", "skip"] = "error",
        show_progress: bool = False,
    ):
        check_settings(max_seq_len, on_bad_sample)
        self.source = open_source(path)  # JSONL, Parquet or a save_to_disk folder
        self.path = self.source.path
        self.processor = processor
        self.max_seq_len = max_seq_len
        self.report = DataReport(str(self.path))
        self.conversations: list[Conversation] = []
        self._encoded: list[EncodedConversation] = []
        for _, _, item, encoded in checked_samples(
            self.source.rows(), processor, max_seq_len, on_bad_sample, self.report, show_progress
        ):
            self.conversations.append(item)
            self._encoded.append(encoded)
        finish_report(self.report)

    def __len__(self) -> int:
        return len(self._encoded)

    def num_tokens(self, index: int) -> int:
        """Tokens of sample `index` (image placeholders expanded), known without processing it."""
        return len(self._encoded[index].input_ids)

    def sample_name(self, index: int) -> str:
        """Where sample `index` is: "file:line" (JSONL) or "file:row n" (a table), for messages."""
        return self.conversations[index].source

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        encoded = self._encoded[index]
        targets = torch.from_numpy(aligned_targets(encoded.labels))
        input_ids = torch.from_numpy(encoded.input_ids)
        if not is_multimodal(self.processor):
            return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "targets": targets}
        conversation = self.conversations[index]
        outputs = processor_outputs(
            self.processor, conversation.images, conversation.source, encoded.text, input_ids
        )
        return {**outputs, "targets": targets}


def processor_outputs(processor, images: list[Path], source: str, text: str, input_ids: torch.Tensor) -> dict:
    """The processor's tensors for one sample (per-token ones cut to its measured length), checked
    against the ids measured when the dataset was loaded."""
    pixels = [load_rgb(path, source) for path in images]
    out = processor(text=[text], images=pixels or None, return_tensors="pt", add_special_tokens=False)
    length = len(input_ids)
    if not torch.equal(out["input_ids"][0, :length], input_ids):
        raise RuntimeError(
            f"{source}: the processor's token ids differ from those measured when the "
            "dataset was loaded (was the processor or an image changed after loading the dataset?)"
        )
    sample = {}
    for key, value in out.items():
        if key in PER_TOKEN_KEYS or key in PER_TOKEN_IMAGE_KEYS:
            sample[key] = value[0, :length]
        elif isinstance(value, torch.Tensor):
            sample[key] = value
    return sample


def check_settings(max_seq_len: int, on_bad_sample: str) -> None:
    if on_bad_sample not in ("error", "skip"):
        raise DataError(f"on_bad_sample must be 'error' or 'skip', got {on_bad_sample!r}")
    if max_seq_len < 2:
        raise DataError(f"max_seq_len must be at least 2, got {max_seq_len}")


def checked_samples(
    lines: Iterable[tuple[int, int, Conversation | BadSample]],
    processor,
    max_seq_len: int,
    on_bad_sample: str,
    report: DataReport,
    show_progress: bool = False,
    total: int | None = None,
) -> Iterator[tuple[int, int, Conversation, EncodedConversation]]:
    """(line number, byte offset, conversation, encoding) of each usable line, in order, counting the rest in `report`.

    The one place a line is judged: the dataset read every start and the data cache's build share it, so
    both keep, cut and skip exactly the same lines with the same messages."""
    desc = f"encoding {Path(report.path).name}"
    for number, offset, item in progress(
        lines, desc=desc, unit="line", total=total, disable=not show_progress
    ):
        try:
            if isinstance(item, BadSample):
                raise item
            encoded = encode(processor, item, max_seq_len)
        except BadSample as bad:
            if on_bad_sample == "error":
                raise BadSample(
                    bad.source,
                    bad.reason,
                    f"{bad.detail} (or set data.on_bad_sample=skip to skip such lines)",
                ) from None
            report.skipped[bad.reason] += 1
            if len(report.examples) < 5:
                report.examples.append(str(bad))
            continue
        report.kept += 1
        report.truncated += encoded.truncated
        yield number, offset, item, encoded


def finish_report(report: DataReport) -> None:
    """Log what was skipped; refuse a file with nothing usable."""
    if report.num_skipped:
        log.warning("%s; first ones: %s", report.summary(), " | ".join(report.examples))
    if not report.kept:
        raise DataError(f"{report.path}: no usable samples ({report.summary()})")


def load_rgb(path, source: str) -> Image.Image:
    """The image as RGB (what every processor expects); `source` ("file:line") names it in errors.
    `path`: a file, or an image in a Parquet / Arrow row (ntil_ds/data/tables.py: read now)."""
    try:
        with open_image(path) as image:
            return image.convert("RGB")
    except Exception as error:  # decoding errors the header check at load time could not see
        raise DataError(f"{source}: image {path} cannot be decoded ({error})") from None
