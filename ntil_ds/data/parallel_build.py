"""The data cache's first build split over several processes: the node's ranks, or a worker pool.

The source's samples (JSONL: its lines) are cut into contiguous index ranges ``[start, stop)``, a few
per process (``PARTS_PER_PROCESS``: a slow process leaves its last ranges to the others). Every process
claims the next unclaimed range (``part-K.claim``, holding its pid: written to a temporary file first, then
hard-linked into place, so a claim is never seen empty or half written), encodes it with the same
``checked_samples`` as a serial build into its own part files, and marks it done (``part-K.done``,
renamed into place last). The builder (the main rank, holding the cache's exclusive lock for the whole
build) joins the parts in range order into the ``CacheWriter`` and commits atomically as before: the
arrays, the skip counts (in order of first occurrence) and the first skip messages are byte for byte
those of a serial build (tests/unit/test_data_cache.py).

Everything is coordinated through files in ``<cache root>/.<slot>.tmp-parts/`` (``ticket.json``: the
build's key and ranges, written before the builder lets the other ranks past the collective), never in a
collective: a long build would pass a collective's timeout. Other ranks help only a build of the same
key on the same host whose builder is alive and holds the lock; then they wait on the lock as before.
A process that fails (a bad line with ``on_bad_sample=error``) writes ``error.json``; every process
checks it about once a second and raises the same error, so all ranks end with it, none hangs. The
builder re-encodes a range whose claimant died: no such process, a zombie (killed, e.g. by the OOM killer,
and not yet reaped: ``os.kill(pid, 0)`` still succeeds on it; ``_alive`` reads its state in ``/proc``),
or a claim with no pid in it (left by an older build's claimant killed between creating and writing it).
The builder also reaps its own pool workers while it waits; a helper stops when the builder is dead.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import shutil
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ntil_ds.data.dataset import DataReport, checked_samples
from ntil_ds.data.encoding import aligned_targets
from ntil_ds.data.progress import progress
from ntil_ds.data.records import BadSample
from ntil_ds.data.tables import image_text

PARTS_PER_PROCESS = 4
AUTO_MIN_LINES = 50_000  # data.encode_workers=0: a pool from this many lines (a worker starts in seconds)
AUTO_MAX_WORKERS = 8
CHECK_EVERY_S = 1.0  # how often an encoding process looks for another's error
POLL_S = 0.05
PER_SAMPLE = ("lines", "line_offsets")
ENDS = ("offsets", "text_offsets", "images_offsets")


def pool_size(encode_workers: int, lines: int) -> int:
    """Processes of a one-rank build: ``encode_workers``, or (0) the CPUs this process may use, at most
    ``AUTO_MAX_WORKERS``, where the data has at least ``AUTO_MIN_LINES`` lines (else 1: no pool)."""
    if encode_workers:
        return max(1, min(encode_workers, lines))
    if lines < AUTO_MIN_LINES:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), AUTO_MAX_WORKERS))


@dataclass
class RangeEncoder:
    """What encodes a range of the source's samples; picklable for a pool worker (the processor travels
    as its folder when it does not pickle, and is checked against the key there)."""

    source: Any  # a DataSource (ntil_ds/data/sources.py): JSONL, Parquet or save_to_disk
    processor: Any
    max_seq_len: int
    on_bad_sample: str
    multimodal: bool

    @property
    def path(self) -> Path:
        return self.source.path

    def samples(self, start: int, stop: int | None, report: DataReport, **progress_args) -> Iterator:
        lines = self.source.rows(start, stop)  # samples [start, stop) of any source, in order
        return checked_samples(
            lines, self.processor, self.max_seq_len, self.on_bad_sample, report, **progress_args
        )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        try:
            pickle.dumps(self.processor)
        except Exception:
            from ntil_ds.data.cache import processor_source

            state["processor"] = ("folder", processor_source(self.processor))
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if isinstance(self.processor, tuple):
            from ntil_ds.data.processor import load_processor

            self.processor = load_processor(self.processor[1])


def write_samples(samples: Iterable, writer, multimodal: bool) -> None:
    """The cache arrays of ``samples`` (``checked_samples``' tuples), appended to ``writer``; the serial
    build and every part of a parallel one write through this."""
    import array

    per_sample = {name: array.array("q") for name in PER_SAMPLE}
    ends = {name: array.array("q", [0]) for name in ENDS}
    for number, offset, conversation, encoded in samples:
        per_sample["lines"].append(number)
        per_sample["line_offsets"].append(offset)
        writer.append("input_ids", encoded.input_ids)  # int32: every vocabulary is far below 2**31
        writer.append("targets", aligned_targets(encoded.labels))
        ends["offsets"].append(ends["offsets"][-1] + len(encoded.input_ids))
        if multimodal:
            text = encoded.text.encode("utf-8")
            images = "\0".join(map(image_text, conversation.images)).encode("utf-8")
            writer.append("text", text)
            writer.append("images", images)
            ends["text_offsets"].append(ends["text_offsets"][-1] + len(text))
            ends["images_offsets"].append(ends["images_offsets"][-1] + len(images))
    for name, values in {**per_sample, **ends}.items():
        if name in writer.names:
            writer.append(name, values.tobytes())


class PartWriter:
    """One range's arrays: plain files in a folder (the join copies them into the CacheWriter)."""

    def __init__(self, folder: Path, names: dict[str, str]) -> None:
        shutil.rmtree(folder, ignore_errors=True)  # what a dead claimant left
        folder.mkdir()
        self.names = names
        self.files = {name: (folder / f"{name}.bin").open("wb") for name in names}

    def append(self, name: str, values) -> None:
        data = values if isinstance(values, bytes) else np.asarray(values, dtype=self.names[name]).tobytes()
        self.files[name].write(data)

    def close(self) -> None:
        for file in self.files.values():
            file.close()


def parts_folder(root: Path, slot: str) -> Path:
    return root / f".{slot}.tmp-parts"  # ".tmp-": cache.remove_leftovers takes what a killed build left


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(value))
    os.rename(tmp, path)  # whole or absent for a reader


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A pid <= 0 is none (``os.kill(0, 0)`` signals this process's group:
    it would always succeed); a zombie (dead, its parent has not waited for it yet) or a dying process
    (state Z or X in ``/proc/<pid>/stat``) is dead, though ``os.kill`` still finds it. Without a
    readable ``/proc`` (not Linux), the ``os.kill`` check alone."""
    if pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        pass  # gone (the kill check says so too), or no /proc
    else:
        # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
        return stat.rpartition(")")[2].split()[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Aborted(Exception):
    """A helper stops: the build it helped is gone (its builder ended); it then waits for the lock."""


class PartedBuild:
    """One parallel build's folder, as its builder and every helper see it."""

    def __init__(self, folder: Path, ticket: dict, encoder: RangeEncoder, names: dict[str, str]) -> None:
        self.folder, self.ticket, self.encoder, self.names = folder, ticket, encoder, names
        self.ranges = [tuple(r) for r in ticket["ranges"]]
        self.mine: list[int] = []  # the ranges this process encoded
        self.last_check = time.monotonic()

    @classmethod
    def start(
        cls, root: Path, slot: str, key: dict, lines: int, processes: int, encoder, names
    ) -> PartedBuild:
        """The builder (holding the exclusive lock): a fresh folder and its ticket."""
        folder = parts_folder(root, slot)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        count = max(1, min(lines, processes * PARTS_PER_PROCESS))
        bounds = [lines * k // count for k in range(count + 1)]
        ticket = {
            "id": uuid.uuid4().hex,
            "key": key,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ranges": [[bounds[k], bounds[k + 1]] for k in range(count)],
            "names": names,
        }
        _write_json(folder / "ticket.json", ticket)
        return cls(folder, ticket, encoder, names)

    @classmethod
    def find(cls, root: Path, slot: str, key: dict, encoder) -> PartedBuild | None:
        """The build in progress that this process can help: same key, same host, builder alive and
        holding the lock; else None."""
        folder = parts_folder(root, slot)
        try:
            ticket = json.loads((folder / "ticket.json").read_text())
        except (OSError, ValueError):
            return None
        if ticket.get("key") != key or ticket.get("host") != socket.gethostname():
            return None
        if not _alive(ticket["pid"]) or not _lock_held(root, slot):
            return None
        return cls(folder, ticket, encoder, ticket["names"])

    # -- every process ----------------------------------------------------------------------------

    def work(self, on_lines: Callable[[int], None] | None = None) -> None:
        """Claim and encode ranges until none is left unclaimed."""
        for k in range(len(self.ranges)):
            if self._claim(k):
                self.encode(k, on_lines)

    def _claim(self, k: int) -> bool:
        # The pid goes into a file of this process's own first, then that is linked to the claim's name
        # (atomic; FileExistsError when another process claimed the range first): a claim file is never
        # empty while its claimant lives. (O_EXCL, then a write, left an empty claim when the claimant was
        # killed in between; read as pid 0 it looked alive forever and the builder waited forever.)
        tmp = self.folder / f".claiming-{k:05d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # no ".claim" suffix
        try:
            tmp.write_text(str(os.getpid()))
            os.link(tmp, self.folder / f"part-{k:05d}.claim")
        except FileExistsError:
            return False
        except FileNotFoundError:  # the folder is gone: the build ended
            raise Aborted from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return True

    def _claimant(self, k: int) -> int:
        """The pid in range ``k``'s claim; 0 (no process: dead) when it holds none."""
        try:
            return int((self.folder / f"part-{k:05d}.claim").read_text())
        except ValueError:  # empty: an older build's claimant killed between creating and writing it
            return 0

    def encode(self, k: int, on_lines: Callable[[int], None] | None = None) -> None:
        start, stop = self.ranges[k]
        self.mine.append(k)
        report = DataReport(str(self.encoder.path))
        writer = PartWriter(self.folder / f"part-{k:05d}", self.names)
        try:
            samples = self._watched(self.encoder.samples(start, stop, report), start, stop, on_lines)
            write_samples(samples, writer, self.encoder.multimodal)
        except (Aborted, KeyboardInterrupt):
            raise
        except Exception as error:
            self._record(error)
            raise
        finally:
            writer.close()
        state = {"kept": report.kept, "truncated": report.truncated,
                 "skipped": list(report.skipped.items()), "examples": report.examples, "lines": stop - start}  # fmt: skip
        _write_json(self.folder / f"part-{k:05d}.done", state)

    def _watched(self, samples: Iterator, start: int, stop: int, on_lines) -> Iterator:
        seen = start  # lines [start, seen) done (a sample's number is its line's index + 1)
        for sample in samples:
            yield sample
            if on_lines is not None:
                on_lines(sample[0] - seen)
                seen = sample[0]
            if time.monotonic() - self.last_check >= CHECK_EVERY_S:
                self.check()
        if on_lines is not None:
            on_lines(stop - seen)

    def check(self) -> None:
        """Raise the error another process of the build recorded; a helper stops when the builder ended."""
        self.last_check = time.monotonic()
        try:
            error = json.loads((self.folder / "error.json").read_text())
        except FileNotFoundError:
            error = None
        except (OSError, ValueError):
            return  # being written: seen at the next check
        if error is not None:
            if error["kind"] == "BadSample":
                raise BadSample(error["source"], error["reason"], error["detail"])
            raise RuntimeError(
                f"{self.encoder.path}: the data cache build failed in another process (pid "
                f"{error['pid']}): {error['message']}"
            )
        if self.ticket["pid"] != os.getpid() and not _alive(self.ticket["pid"]):
            raise Aborted

    def _record(self, error: Exception) -> None:
        if isinstance(error, BadSample):
            value = {
                "kind": "BadSample",
                "source": error.source,
                "reason": error.reason,
                "detail": error.detail,
            }
        else:
            value = {"kind": "other", "message": f"{type(error).__name__}: {error}"}
        if not (self.folder / "error.json").exists():  # the first error stays
            _write_json(self.folder / "error.json", {**value, "pid": os.getpid()})

    # -- the builder ------------------------------------------------------------------------------

    def finish(self, writer, show_progress: bool, pool: int = 1) -> DataReport:
        """Encode with the others (``pool - 1`` worker processes started here, or the helping ranks), wait
        for every range, join them into ``writer``; the report of the whole source."""
        lines = self.ranges[-1][1]
        bar = progress(total=lines, desc=f"encoding {self.encoder.path.name}", unit="line",
                       disable=not show_progress)  # fmt: skip
        workers = _start_pool(self, pool - 1)
        counted: set[int] = set()
        try:
            try:
                self.work(bar.update)
                counted |= {k for k in range(len(self.ranges)) if self._done(k)}
                self._wait(bar, counted, workers)
            except Exception as error:
                self._record(error)  # the helpers stop with it
                raise
            finally:
                for process in workers:
                    process.join(timeout=0 if (self.folder / "error.json").exists() else None)
                    if process.is_alive():
                        process.terminate()
                        process.join()
        finally:
            bar.close()
        return self._join(writer)

    def _done(self, k: int) -> bool:
        return (self.folder / f"part-{k:05d}.done").exists()

    def _wait(self, bar, counted: set[int], workers: list) -> None:
        while len(counted) < len(self.ranges):
            self.check()
            for process in workers:
                # is_alive() reaps a pool worker that ended (killed: a zombie until its parent waits for
                # it). _alive sees a zombie as dead already; this also covers a system without /proc.
                process.is_alive()
            for k in range(len(self.ranges)):
                if k in counted:
                    continue
                if self._done(k):
                    counted.add(k)
                    bar.update(self.ranges[k][1] - self.ranges[k][0])
                elif not _alive(self._claimant(k)) and not self._done(k):  # (done, then it ended: kept)
                    # (only the builder reads claims, and only it takes a dead claimant's over)
                    (self.folder / f"part-{k:05d}.claim").write_text(str(os.getpid()))
                    self.encode(k)  # its claimant died (or was killed): encoded here instead
            time.sleep(POLL_S)

    def _join(self, writer) -> DataReport:
        report = DataReport(str(self.encoder.path))
        skipped: Counter = Counter()
        base = dict.fromkeys(ENDS, 0)
        for k in range(len(self.ranges)):
            part = self.folder / f"part-{k:05d}"
            state = json.loads((self.folder / f"part-{k:05d}.done").read_text())
            report.kept += state["kept"]
            report.truncated += state["truncated"]
            for reason, count in state["skipped"]:
                skipped[reason] += count  # a reason's place: its first line, as in a serial build
            report.examples = (report.examples + state["examples"])[:5]
            for name, dtype in self.names.items():
                if name in ENDS:
                    ends = np.fromfile(part / f"{name}.bin", dtype=dtype)
                    writer.append(name, (ends if k == 0 else ends[1:] + base[name]).astype(dtype).tobytes())
                    base[name] += int(ends[-1])
                else:
                    with (part / f"{name}.bin").open("rb") as file:
                        while chunk := file.read(1 << 24):  # a multiple of every itemsize
                            writer.append(name, chunk)
        report.skipped = skipped
        return report

    def close(self) -> None:
        """After the commit: the folder goes."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def fail(self, error: Exception) -> None:
        """After a failure the folder stays, its error.json telling the helpers (still encoding, or
        waiting for the lock); the next build's ``remove_leftovers`` takes it."""
        self._record(error)


def _lock_held(root: Path, slot: str) -> bool:
    with open(root / f"{slot}.lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def _start_pool(build: PartedBuild, count: int) -> list:
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # fork would copy a process with threads (torch, gloo)
    workers = [
        context.Process(target=_pool_worker, args=(build.folder, build.ticket, build.encoder), daemon=True)
        for _ in range(count)
    ]
    for process in workers:
        process.start()
    return workers


def _pool_worker(folder: Path, ticket: dict, encoder: RangeEncoder) -> None:
    from ntil_ds.data.cache import processor_digest

    if processor_digest(encoder.processor) != ticket["key"]["processor_sha256"]:
        return  # the processor loaded again here is not the builder's: the builder encodes the rest
    with contextlib.suppress(Aborted, BadSample):  # a bad line: in error.json, the builder raises it
        PartedBuild(folder, ticket, encoder, ticket["names"]).work()
