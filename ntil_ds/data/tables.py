"""Parquet files and `datasets` ``save_to_disk`` folders: rows read with pyarrow, checked as JSONL lines.

A row holds the same layouts as a JSONL line (``messages``, or ShareGPT ``conversations`` with ``image``
/ ``images``; ntil_ds/data/records.py), its images as paths or as the Hugging Face image struct
``{"bytes": ..., "path": ...}`` (one, or a list of them in an ``images`` column). A row is named
``<file>:row <n>``, n counted from 0 in that file (``pyarrow.parquet.read_table(file)[n]``). A
``messages`` (or ``conversations``) column may also be a string column of JSON text (what pandas or Spark
exports of nested data often hold): it is decoded here, and a row whose text is not JSON is a bad sample.

Images stay lazy: the bytes of an embedded image are checked (opened, verified) when the rows are read,
and then let go; the sample keeps a `RowImage` (file, row, where in the row), and the bytes are read
again when the sample is (`RowImage.read_bytes`: one row group's column of a Parquet file, one row of a
memory-mapped Arrow file). A row whose bytes are not an image is a bad sample like any other (counted
and named with ``data.on_bad_sample=skip``), never left out unseen.

``save_to_disk`` folders are read with pyarrow directly, not with ``datasets.load_from_disk``: their
data is Arrow IPC stream files listed in ``state.json``, which pyarrow maps as they are, so no new
dependency enters the training image (``datasets`` brings dill, multiprocess, xxhash and a hub client)
and both table formats share one reader. The cost: a folder written by a future ``datasets`` with
another layout is refused here (the error says so) until this reader learns it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ntil_ds.data.records import BadSample, Conversation, DataError, parse_row

_BATCH_ROWS = 256  # rows converted to Python at a time while checking (their image bytes then let go)
_CHUNK = 1 << 20
_JSON_COLUMNS = ("messages", "conversations")  # may be stored as JSON text (a string column)


@dataclass(frozen=True)
class RowImage:
    """An image whose bytes are in a row of a table file: ``row[where[0]][where[1]]...["bytes"]``."""

    file: str
    row: int
    where: tuple

    def read_bytes(self) -> bytes:
        value = read_cell(Path(self.file), self.row, self.where[0])
        for key in self.where[1:]:
            value = value[key]
        return value["bytes"]

    def __str__(self) -> str:
        return f"{self.file}:row {self.row} {'.'.join(map(str, self.where))}"


# How the data cache stores a sample's images as text (ntil_ds/data/cached_dataset.py): a path as it is;
# a row's image as this marker (a byte no real path starts with) and its JSON.
_ROW_MARK = "\x01"


def image_text(image) -> str:
    if isinstance(image, RowImage):
        return _ROW_MARK + json.dumps([image.file, image.row, list(image.where)])
    return str(image)


def image_from_text(text: str):
    if text.startswith(_ROW_MARK):
        file, row, where = json.loads(text[1:])
        return RowImage(file, row, tuple(where))
    return Path(text)


class TableSource:
    """Rows of Parquet files (one, or a folder of shards) or of a save_to_disk folder's Arrow files.

    A row is addressed by (row in its file, index of its file): the data cache's (line, offset)."""

    def __init__(self, path: Path, files: list[Path], kind: str) -> None:
        self.path, self.files, self.kind = path, files, kind

    def digest(self) -> tuple[str, int]:
        """sha256 over every file's name and bytes, and the number of rows (from the files' metadata)."""
        digest = hashlib.sha256()
        for file in self.files:
            digest.update(file.name.encode() + b"\0")
            with file.open("rb") as handle:
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
        return digest.hexdigest(), sum(_num_rows(file, self.kind) for file in self.files)

    def name(self, row: int, file_index: int) -> str:
        return f"{self.files[file_index]}:row {row}"

    def rows(
        self, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, int, Conversation | BadSample]]:
        """(row, file index, conversation or its problem) of samples [start, stop), counted over every
        row, file after file (what a parallel cache build gives each rank). Only the range's own rows
        are decoded: whole files and Parquet row groups before `start` are skipped by their metadata's
        row counts, and a save_to_disk Arrow file is sliced (it is memory-mapped)."""
        first = 0  # the overall number of the current file's row 0
        for file_index, file in enumerate(self.files):
            if stop is not None and first >= stop:
                return
            count = _num_rows(file, self.kind)
            begin, end = max(start - first, 0), count if stop is None else min(stop - first, count)
            if begin < end:
                for row, values in _rows_of(file, self.kind, begin, end):
                    yield row, file_index, self._parsed(values, file, row)
            first += count

    def conversation_at(self, row: int, file_index: int) -> Conversation:
        file = self.files[file_index]
        columns = _schema_names(file, self.kind)
        item = self._parsed({c: read_cell(file, row, c) for c in columns}, file, row)
        if isinstance(item, BadSample):
            raise item
        return item

    def first_value(self, key: str):
        """Column `key` of the first row (None: no such column, or no rows)."""
        file = next((f for f in self.files if _num_rows(f, self.kind)), None)
        if file is None or key not in _schema_names(file, self.kind):
            return None
        return read_cell(file, 0, key)

    def _parsed(self, values: dict, file: Path, row: int) -> Conversation | BadSample:
        source = f"{file}:row {row}"
        try:
            return parse_row(
                _decoded_columns(values, source),
                source,
                file.parent,
                functools.partial(RowImage, str(file), row),
            )
        except BadSample as bad:
            return bad


def _decoded_columns(values: dict, source: str) -> dict:
    """A ``messages`` (or ``conversations``) column stored as a JSON string, as many Parquet exports write
    it (pandas, Spark), decoded into the list it holds; a string that is not JSON is a bad sample."""
    for column in _JSON_COLUMNS:
        text = values.get(column)
        if isinstance(text, str):
            try:
                values = {**values, column: json.loads(text)}
            except json.JSONDecodeError as error:
                raise BadSample(
                    source,
                    "malformed_json",
                    f"column '{column}' is a string that is not valid JSON ({error}); store the list of "
                    f"messages itself, or its JSON text (json.dumps of the list)",
                ) from None
    return values


def save_to_disk_files(folder: Path) -> list[Path]:
    """The Arrow files of a folder written by ``Dataset.save_to_disk``, in order (from its state.json)."""
    try:
        state = json.loads((folder / "state.json").read_text())
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{folder}: state.json does not list the data files as datasets' save_to_disk writes them "
            f"({type(error).__name__}: {error}); save the data set again with Dataset.save_to_disk"
        ) from None
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(
            f"{folder}: the Arrow files its state.json lists are missing: {missing or 'none listed'}"
        )
    return files


def parquet_shards(folder: Path) -> list[Path]:
    """The ``*.parquet`` files directly in `folder`, by name (sub-folders, e.g. other splits, are not read)."""
    return sorted(p for p in folder.glob("*.parquet") if p.is_file())


# Per process (a loader worker started by fork opens its own): open files and the last row group read.


@functools.lru_cache(maxsize=64)
def _arrow_table(file: Path, pid: int):
    import pyarrow as pa

    try:
        with pa.memory_map(str(file)) as source:  # zero copy: the table's buffers are the mapped file
            return pa.ipc.open_stream(source).read_all()
    except pa.ArrowException as error:
        raise DataError(f"{file}: cannot be read as an Arrow stream file ({error})") from None


@functools.lru_cache(maxsize=64)
def _parquet_file(file: Path, pid: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(str(file))
    except pa.ArrowException as error:
        raise DataError(f"{file}: cannot be read as Parquet ({error})") from None
    starts, total = [], 0
    for group in range(parquet.metadata.num_row_groups):
        starts.append(total)
        total += parquet.metadata.row_group(group).num_rows
    return parquet, starts


@functools.lru_cache(maxsize=2)
def _row_group_column(file: Path, pid: int, group: int, column: str):
    parquet, _ = _parquet_file(file, pid)
    return parquet.read_row_group(group, columns=[column]).column(0)


def read_cell(file: Path, row: int, column: str):
    """One cell of a table file as a Python value (a Parquet file reads that row's row group column)."""
    pid = os.getpid()
    if file.suffix == ".parquet":
        import bisect

        _, starts = _parquet_file(file, pid)
        group = bisect.bisect_right(starts, row) - 1
        return _row_group_column(file, pid, group, column)[row - starts[group]].as_py()
    return _arrow_table(file, pid).column(column)[row].as_py()


def _schema_names(file: Path, kind: str) -> list[str]:
    if kind == "parquet":
        return _parquet_file(file, os.getpid())[0].schema_arrow.names
    return _arrow_table(file, os.getpid()).schema.names


def _num_rows(file: Path, kind: str) -> int:
    if kind == "parquet":
        return _parquet_file(file, os.getpid())[0].metadata.num_rows
    return _arrow_table(file, os.getpid()).num_rows


def _rows_of(file: Path, kind: str, begin: int, end: int) -> Iterator[tuple[int, dict]]:
    """(row, values) of rows [begin, end) of one file, converted to Python `_BATCH_ROWS` at a time. Of a
    Parquet file only the row groups that hold them are read."""
    if kind == "parquet":
        parquet, starts = _parquet_file(file, os.getpid())
        metadata = parquet.metadata
        groups = [
            g
            for g, first in enumerate(starts)
            if first < end and first + metadata.row_group(g).num_rows > begin
        ]
        row = starts[groups[0]]
        batches = parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups)
    else:  # memory-mapped: the slice is free
        row = begin
        batches = _arrow_table(file, os.getpid()).slice(begin, end - begin).to_batches(_BATCH_ROWS)
    for batch in batches:
        low, high = max(begin - row, 0), min(end - row, batch.num_rows)
        for offset, values in enumerate(batch.slice(low, max(high - low, 0)).to_pylist()):
            yield row + low + offset, values
        row += batch.num_rows
        if row >= end:
            return
