"""Which test items a comparison was scored on, by content rather than by path.

A split is any input the trainer reads (JSONL, .parquet, a folder of shards, a save_to_disk folder),
read by the trainer's reader (ntil_ds/data/sources.py).

- :func:`split_hash`: sha256 of the test file's bytes and of every image it names (in order), so two
  grids whose test files sit at one path but were drawn again (another size, another seed) differ,
  and one split copied elsewhere is still the same.
- :func:`item_hashes`: one sha256 per item, of its prompt and answer (the parsed messages, images
  as placeholders) and its images' bytes: what a test item shares with a training item of another
  draw (a larger draw with the same seed repeats the smaller one's items, split differently).
- :func:`refuse_overlap`: a test split any of whose items is in a training split it is compared with
  is refused, with how many and one example of each side.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ntil_ds.data import BadSample
from ntil_ds.data.cache import update_with_file
from ntil_ds.data.records import DataError
from ntil_ds.data.sources import open_source, read_samples


def split_hash(split: Path) -> str:
    """sha256 over the split's bytes (each of its files', in order), then each image file its lines name,
    in order of first mention (an image inside a table row is in the table's bytes already)."""
    try:
        files = open_source(split).files
    except DataError as error:
        raise SystemExit(f"test split {split}: its content cannot be compared ({error})") from None
    digest = hashlib.sha256()
    for file in files:
        update_with_file(digest, file)
    seen: set[Path] = set()
    for conversation in read_samples(split):
        if isinstance(conversation, BadSample):
            continue
        for image in conversation.images:
            if isinstance(image, Path) and image not in seen:
                seen.add(image)
                digest.update(b"\0image\0")
                update_with_file(digest, image)
    return digest.hexdigest()


def item_hashes(split: Path) -> dict[str, str]:
    """{sha256 of one item's prompt + answer + image bytes: the item's "file:line"} of every usable line
    (an image's bytes as they are, from its file or from its table row: a Parquet copy of a JSONL split
    has the same items)."""
    hashes = {}
    for conversation in read_samples(split):
        if isinstance(conversation, BadSample):
            continue
        digest = hashlib.sha256(json.dumps(conversation.messages, sort_keys=True).encode())
        for image in conversation.images:
            digest.update(b"\0image\0")
            if isinstance(image, Path):
                update_with_file(digest, image)
            else:
                digest.update(image.read_bytes())
        hashes.setdefault(digest.hexdigest(), conversation.source)
    return hashes


def refuse_overlap(test: Path, train_splits: list[Path]) -> None:
    """SystemExit when an item of ``test`` is also in one of ``train_splits`` (the model trained on it)."""
    tested = item_hashes(test)
    for train in dict.fromkeys(Path(t) for t in train_splits):
        shared = tested.keys() & (trained := item_hashes(train)).keys()
        if shared:
            example = next(iter(shared))
            raise SystemExit(
                f"{len(shared)} of the {len(tested)} test items of {test} are in the training split {train} "
                f"(e.g. {tested[example]} is {trained[example]}): a model trained there has seen them. Score "
                "on a test split drawn apart from every training split it is compared with"
            )
