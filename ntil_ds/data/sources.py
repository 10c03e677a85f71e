"""What ``data.train_file`` / ``data.eval_file`` may name, and the reader of each: a data source.

- a file ending in ``.parquet``: Parquet (ntil_ds/data/tables.py);
- a folder with ``state.json``: a ``datasets`` ``Dataset.save_to_disk`` folder (its Arrow files);
- a folder with ``*.parquet`` files directly in it: those shards, in name order;
- any other file: JSONL, one conversation per line (ntil_ds/data/records.py), as always.

Anything else (a missing path, a folder with neither, a ``DatasetDict`` folder, a folder with both) is
refused with what is accepted. Every source gives the same things: its rows as (number, offset,
conversation or `BadSample`), where (number, offset) addresses the row again later (a JSONL line's
number and byte offset; a table row's number in its file and the file's index), the name of a row for
messages, and a digest of its files' content for the data cache's key.

Everything that reads data reads it here: the trainer's datasets, and evaluation (``launch/evaluate.py``,
the comparison's splits and controls) through `read_samples` and `first_value`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ntil_ds.data.records import (
    BadSample,
    Conversation,
    DataError,
    read_conversation_at,
    read_jsonl_indexed,
)
from ntil_ds.data.tables import TableSource, parquet_shards, save_to_disk_files

ACCEPTED = (
    "a JSONL file (one conversation per line), a .parquet file, a folder of .parquet shards, "
    "or a folder written by datasets' Dataset.save_to_disk"
)


class JsonlSource:
    """A JSONL file; a line is addressed by (line number, byte offset)."""

    def __init__(self, path: Path) -> None:
        self.path, self.files = path, [path]

    def digest(self) -> tuple[str, int]:
        from ntil_ds.data.cache import file_digest

        return file_digest(self.path)

    def name(self, number: int, offset: int) -> str:
        return f"{self.path}:{number}"

    def rows(
        self, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, int, Conversation | BadSample]]:
        return read_jsonl_indexed(self.path, start, stop)

    def conversation_at(self, number: int, offset: int) -> Conversation:
        return read_conversation_at(self.path, offset, number)

    def first_value(self, key: str):
        """`key` of the first line's object (None: absent, or the line is not a JSON object)."""
        with self.path.open(encoding="utf-8", errors="replace") as lines:
            first = next((line for line in lines if line.strip()), "{}")
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            return None
        return row.get(key) if isinstance(row, dict) else None


DataSource = JsonlSource | TableSource


def open_source(path: str | Path) -> DataSource:
    """The reader for `path` (see the module docstring), or a DataError saying what is accepted."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".parquet":
            return TableSource(path, [path], "parquet")
        return JsonlSource(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
            raise DataError(
                f"{path} is a DatasetDict saved with save_to_disk: give one split's folder "
                f"({', '.join(str(path / s) for s in splits) or 'none found'})"
            )
        shards = parquet_shards(path)
        if (path / "state.json").is_file():
            if shards:
                raise DataError(
                    f"{path} holds both a save_to_disk state.json and .parquet files: it is unclear which "
                    "to read; keep one kind per folder"
                )
            return TableSource(path, save_to_disk_files(path), "arrow")
        if shards:
            return TableSource(path, shards, "parquet")
        raise DataError(
            f"{path}: a folder without .parquet files or a save_to_disk state.json; give {ACCEPTED}"
        )
    raise DataError(f"{path}: data file not found; give {ACCEPTED}")


def read_samples(path: str | Path) -> Iterator[Conversation | BadSample]:
    """Every row of any source, checked (a `Conversation`) or its problem (a `BadSample`), in order."""
    for _, _, item in open_source(path).rows():
        yield item


def first_value(path: str | Path, key: str):
    """The value of `key` (a column of a table) in a source's first row, None where it has none."""
    return open_source(path).first_value(key)
