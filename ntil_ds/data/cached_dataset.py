"""`CachedConversationDataset`: `ConversationDataset`'s samples from the data cache (ntil_ds/data/cache.py).

The first start checks and encodes the file exactly as `ConversationDataset` does (the same
`checked_samples`: the same lines kept, cut and skipped, the same report) and writes the arrays; every
later start, and every other rank, maps them: no line is read, parsed or tokenized again. `dataset[i]`
returns exactly what `ConversationDataset(...)[i]` returns (tests/unit/test_data_cache.py compares every
field of every sample). Images stay lazy: the cache holds their paths, `__getitem__` loads and processes
them as before. `conversations` reads a sample's line again only when it is asked for (evaluation
takes a few).

`load_dataset` is what the trainer calls: with several ranks, the main rank builds (or finds) the cache
and the others wait on its lock, then map it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ntil_ds.data.cache import (
    ARRAYS,
    TEXT_ARRAYS,
    CacheArrays,
    CacheWriter,
    SlotLock,
    cache_key,
    cache_root,
    check,
    remove_leftovers,
    slot_name,
)
from ntil_ds.data.dataset import (
    ConversationDataset,
    DataReport,
    check_settings,
    finish_report,
    processor_outputs,
)
from ntil_ds.data.parallel_build import Aborted, PartedBuild, RangeEncoder, pool_size, write_samples
from ntil_ds.data.processor import is_multimodal
from ntil_ds.data.sources import DataSource, open_source
from ntil_ds.data.tables import image_from_text

log = logging.getLogger(__name__)
# How often a rank waiting for another's build looks whether it can help, map or build itself.
WAIT_FOR_BUILDER_S = 0.2


class CachedConversationDataset(torch.utils.data.Dataset):
    """`ConversationDataset` over mapped arrays. `cache_status` says what happened: "built", "reused",
    or "rebuilt because ..." (also logged). `on_locked`: called once this process holds the exclusive
    build lock, taken only when the cache is missing or stale (`load_dataset` calls it otherwise).

    A first build is split over `ranks` processes (the node's ranks; the others are `helper`s, which
    help a build in progress before they check) or, with one rank, over a pool of `encode_workers`
    processes it starts (0: `parallel_build.pool_size`'s choice); ntil_ds/data/parallel_build.py.
    `identity`: `cache.cache_key`'s (key, line count) as another process computed it for this path and
    processor (the main rank, for the others), so the data is not hashed again here."""

    def __init__(
        self,
        path: str | Path,
        processor,
        max_seq_len: int = 2048,
        on_bad_sample: Literal["error", "skip"] = "error",
        *,
        cache_dir: str | Path | None = None,
        output_dir: str | Path | None = None,
        show_progress: bool = False,
        on_locked: Callable[[], None] | None = None,
        ranks: int = 1,
        encode_workers: int = 0,
        helper: bool = False,
        identity: tuple[dict, int] | None = None,
    ):
        check_settings(max_seq_len, on_bad_sample)
        self.source = open_source(path)  # JSONL, Parquet or save_to_disk (ntil_ds/data/sources.py)
        self.path, self.processor, self.max_seq_len = self.source.path, processor, max_seq_len
        self.multimodal = is_multimodal(processor)
        # (key, line count): the main rank's when given (load_dataset), else read here (every byte)
        key, line_count = identity or cache_key(self.source, processor, max_seq_len, on_bad_sample)
        root = cache_root(self.path, cache_dir, output_dir)
        slot = slot_name(self.path, processor, max_seq_len, on_bad_sample)
        folder = root / slot
        encoder = RangeEncoder(self.source, processor, max_seq_len, on_bad_sample, self.multimodal)
        names = ARRAYS | (TEXT_ARRAYS if self.multimodal else {})
        self.cache_status, build, pool = "reused", None, 1
        with SlotLock(root, slot) as lock:
            helped, arrays, leading = (None, None, False)
            if helper:
                helped, arrays, leading = _help_or_lead(lock, root, slot, folder, key, encoder)
            if arrays is None and not leading:
                # A reader first, the main rank too: a valid cache needs no exclusive lock. The main rank
                # must not take it for a cache that checks: another rank may still be waiting for its
                # shared lock on the same slot from the dataset before (data.eval_file = data.train_file),
                # and would wait on it forever while the main rank waits for it in the collective.
                with lock.held(exclusive=False):
                    arrays, _ = check(folder, key)
                if arrays is None and helped is not None:
                    # killed: this rank builds; failed: its error, here too
                    with contextlib.suppress(Aborted):
                        helped.check()
                if arrays is None:
                    lock.take(exclusive=True)  # one builder; the others wait, then reuse
                    leading = True
            if leading:
                try:
                    arrays, why = check(folder, key)
                    if arrays is None:
                        self.cache_status = "built" if why == "missing" else f"rebuilt because {why}"
                        remove_leftovers(folder)
                        pool = 1 if ranks > 1 else pool_size(encode_workers, line_count)
                        if max(ranks, pool) > 1:  # the ticket is out before the other ranks are let go
                            build = PartedBuild.start(
                                root, slot, key, line_count, max(ranks, pool), encoder, names
                            )
                    if on_locked is not None:
                        on_locked()
                    if arrays is None:
                        try:
                            self._build(folder, key, encoder, names, line_count, show_progress, build, pool)
                        except Exception as error:
                            if build is not None:
                                build.fail(error)  # the helping ranks raise it too
                            raise
                        if build is not None:
                            build.close()
                        arrays, why = check(folder, key)
                        if arrays is None:
                            raise RuntimeError(f"{folder}: the cache just written does not check ({why})")
                finally:
                    lock.release()
        # (ranges this process encoded, ranges of the build) where a build was shared, else None
        parted = helped or build
        self.encoded_ranges = (len(parted.mine), len(parted.ranges)) if parted and parted.mine else None
        share = (
            " (this process encoded {} of {} ranges)".format(*self.encoded_ranges)
            if parted and parted.mine
            else ""
        )
        log.info("data cache %s: %s%s", folder, self.cache_status, share)
        self.cache: CacheArrays = arrays
        saved = arrays.manifest["report"]
        self.report = DataReport(
            str(self.path), saved["kept"], saved["truncated"], Counter(saved["skipped"]), saved["examples"]
        )
        finish_report(self.report)
        self.conversations = LazyConversations(self.source, arrays["lines"], arrays["line_offsets"])

    def _build(self, folder: Path, key: dict, encoder: RangeEncoder, names: dict, line_count: int,
               show_progress: bool, build: PartedBuild | None, pool: int) -> None:  # fmt: skip
        with CacheWriter(folder, names) as writer:
            if build is None:  # one process: the lines in order, straight into the cache
                report = DataReport(str(self.path))
                samples = encoder.samples(0, None, report, show_progress=show_progress, total=line_count)
                write_samples(samples, writer, self.multimodal)
            else:
                report = build.finish(writer, show_progress, pool)
            saved = {"kept": report.kept, "truncated": report.truncated, "skipped": dict(report.skipped)}
            writer.commit(
                {
                    "key": key,
                    "num_samples": report.kept,
                    "multimodal": self.multimodal,
                    "report": {**saved, "examples": report.examples},
                }
            )

    def __len__(self) -> int:
        return len(self.cache["lines"])

    def num_tokens(self, index: int) -> int:
        """Tokens of sample `index` (image placeholders expanded), from the cached offsets."""
        offsets = self.cache["offsets"]
        return int(offsets[index + 1] - offsets[index])

    def lengths(self) -> np.ndarray:
        """Every sample's token count (what packing is planned from), without reading a sample."""
        return np.diff(self.cache["offsets"])

    def sample_name(self, index: int) -> str:
        """Where sample `index` is: "file:line" (JSONL) or "file:row n" (a table), from the cache."""
        return self.source.name(int(self.cache["lines"][index]), int(self.cache["line_offsets"][index]))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = range(len(self))[index]  # negative indices as a list's; out of range: IndexError
        start, end = (int(x) for x in self.cache["offsets"][index : index + 2])
        # int64 copies: what ConversationDataset returns (and writable, which torch expects)
        input_ids = torch.from_numpy(self.cache["input_ids"][start:end].astype(np.int64))
        targets = torch.from_numpy(self.cache["targets"][start:end].astype(np.int64))
        if not self.multimodal:
            return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "targets": targets}
        text = self._string("text", index)
        images = [image_from_text(p) for p in self._string("images", index).split("\0") if p]
        source = self.sample_name(index)
        return {**processor_outputs(self.processor, images, source, text, input_ids), "targets": targets}

    def _string(self, name: str, index: int) -> str:
        start, end = (int(x) for x in self.cache[f"{name}_offsets"][index : index + 2])
        return self.cache[name][start:end].tobytes().decode("utf-8")


def _help_or_lead(lock: SlotLock, root: Path, slot: str, folder: Path, key: dict, encoder: RangeEncoder
                  ) -> tuple[PartedBuild | None, CacheArrays | None, bool]:  # fmt: skip
    """What a rank other than the main one does first: help this host's build of the cache, or map the
    cache once it checks, or, when no process holds its lock and it does not check (a node-local
    ``cache_dir`` on a node other than the main rank's), take the exclusive lock and build it, the
    node's other ranks helping, as on the main rank's node: each node's cache is then built in parallel,
    at the same time as the others'. It never blocks on the lock while a build may start, or it would
    not help it and the node would encode serially while the rest of the job waits in a collective.
    Returns (the build it helped, the cache when it checks, True when it holds the exclusive lock)."""
    while True:
        helped = PartedBuild.find(root, slot, key, encoder)
        if helped is not None:
            with contextlib.suppress(Aborted):  # the builder ended: the caller finds out how
                helped.work()
            return helped, None, False
        if lock.take(exclusive=False, wait=False):
            try:
                arrays, _ = check(folder, key)
            finally:
                lock.release()
            if arrays is not None:
                return None, arrays, False
            if lock.take(exclusive=True, wait=False):
                return None, None, True
        time.sleep(WAIT_FOR_BUILDER_S)


class LazyConversations(Sequence):
    """The kept samples' conversations, each read again from its line when asked for (images checked)."""

    def __init__(self, source: DataSource, lines: np.ndarray, line_offsets: np.ndarray) -> None:
        self.source, self.lines, self.line_offsets = source, lines, line_offsets

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]
        return self.source.conversation_at(int(self.lines[index]), int(self.line_offsets[index]))


# What load_dataset returns: the cached dataset, or the plain one with data.cache=false.
AnyConversationDataset = ConversationDataset | CachedConversationDataset


def load_dataset(
    path: str | Path,
    processor,
    max_seq_len: int,
    on_bad_sample: Literal["error", "skip"],
    *,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    output_dir: str | Path | None = None,
    is_main: bool = True,
    share: Callable[[Any], Any] | None = None,
    ranks: int = 1,
    encode_workers: int = 0,
) -> AnyConversationDataset:
    """The dataset of one data file on this rank; progress on the main rank only.

    `cache=False`: every rank reads and encodes the file (`ConversationDataset`, as before the cache).
    Otherwise, with several ranks (`share`: a collective every rank calls once, returning the main
    rank's argument on every rank: `dist.broadcast_from_main`), the main rank computes the cache's key
    (the sha256 of every byte of the data: once, not once per rank) and takes the cache's build lock,
    and only then lets the others past the collective with the key: they wait on that lock, not in a
    collective (whose timeout a long first build would pass), then map what it wrote. A first build is
    split over the node's `ranks` (each encodes ranges of lines, the main rank joins them), or with one
    rank over `encode_workers` processes (ntil_ds/data/parallel_build.py). Where the cache folder is on
    each node's own disk, the first rank of each other node to get its lock builds it the same way, with
    its node's ranks, at the same time as the main rank's node.
    """
    if not cache:
        return ConversationDataset(path, processor, max_seq_len, on_bad_sample, show_progress=is_main)

    def open_cache(
        show: bool, on_locked=None, helper: bool = False, identity=None
    ) -> CachedConversationDataset:
        return CachedConversationDataset(
            path,
            processor,
            max_seq_len,
            on_bad_sample,
            cache_dir=cache_dir,
            output_dir=output_dir,
            show_progress=show,
            on_locked=on_locked,
            ranks=ranks,
            encode_workers=encode_workers,
            helper=helper,
            identity=identity,
        )

    if share is None:
        return open_cache(is_main)
    if not is_main:
        # past it, the main rank holds the lock and its build's ticket is out; None: it failed before
        # (a missing file), and this rank finds out itself
        return open_cache(False, helper=True, identity=share(None))
    identity: list = [None]  # the main rank's (key, line count), once computed
    released = []

    def release() -> None:
        if not released:
            released.append(True)
            share(identity[0])

    try:
        identity[0] = cache_key(open_source(path), processor, max_seq_len, on_bad_sample)
        return open_cache(True, on_locked=release, identity=identity[0])
    finally:
        release()  # a failure before the lock was taken must not leave the others in the collective
