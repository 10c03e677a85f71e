"""The data cache: a JSONL file encoded once, into plain arrays that every rank and every later start maps.

Why numpy memory maps (``np.memmap`` over raw little-endian files) and not Arrow: no new dependency
(numpy is already everywhere here; ``pyarrow``/``datasets`` are not in the training image); the files
are plain, so any rank, node or loader worker maps them read-only with nothing to import or convert;
and a mapped file is in the OS page cache once per machine, shared by the node's ranks and their
loader workers, instead of a copy of Python objects in each. A sample is a slice of two arrays.

A cache folder (``<root>/<data file stem>-<slot>/``, one per data file, processor, ``max_seq_len`` and
``on_bad_sample``) holds ``manifest.json`` and one ``<name>.bin`` per array (see ``ARRAYS``). The
manifest records the key the arrays were built for: the data file's content (sha256 of its bytes,
read in chunks: a size and a modification time can stay the same while a digit changes) and its
path (`data_identity`), the processor as loaded (its class, modality and serialised form: `processor_digest`),
``max_seq_len``, the on-bad-sample rule, ``ENCODING_VERSION`` and the versions of the libraries that
tokenize. A cache whose key differs, or with a file missing or of the wrong size,
or an unreadable manifest, is rebuilt, never used; the log says which it was (built / reused /
rebuilt because ...). Image files are not in the key (hashing every image would cost what the cache
saves): they are read when a sample is, and a changed image size is caught there by the check that
the processor's ids equal the cached ones.

Writing is atomic: a build writes into a temporary folder beside the final one, fsyncs every file and
the folder, and renames it into place (``os.rename`` of a folder is atomic on POSIX file systems), so
no reader ever sees half a cache. Builders hold an exclusive ``fcntl.flock`` on ``<slot>.lock`` in the
cache root for the whole build, and readers a shared one while they check and map, so two jobs never
build the same cache at once: the second waits, then maps what the first wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# Bump whenever the encoding (ntil_ds/data/encoding.py, records.py) or the cache's layout changes what
# a cache would hold: every existing cache then rebuilds.
ENCODING_VERSION = 1
CACHE_FOLDER = ".ntil_cache"
MANIFEST = "manifest.json"
# name -> dtype. Per token: input_ids, targets (labels already aligned, as __getitem__ returns them).
# Per sample: offsets (N+1: sample i is tokens offsets[i]:offsets[i+1]), lines (its line number in the
# data file), line_offsets (that line's byte offset: the conversation is read again only when asked for).
# Multimodal processors add the rendered text and the image paths of each sample (utf-8 bytes, with
# offsets like the tokens'; paths joined by NUL, which no path holds).
ARRAYS = {
    "input_ids": "<i4",
    "targets": "<i4",
    "offsets": "<i8",
    "lines": "<i8",
    "line_offsets": "<i8",
}
TEXT_ARRAYS = {"text": "|u1", "text_offsets": "<i8", "images": "|u1", "images_offsets": "<i8"}
_CHUNK = 1 << 20


def file_digest(path: Path) -> tuple[str, int]:
    """sha256 of the file's bytes, and its number of lines (for the progress bar), in one read."""
    digest, lines, last = hashlib.sha256(), 0, b"\n"
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return digest.hexdigest(), lines + (last != b"\n")


def update_with_file(digest, path: Path) -> None:
    """Feed a file's bytes to a hashlib digest, a chunk at a time."""
    with Path(path).open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)


def processor_source(processor) -> str:
    """Where the processor was loaded from (a folder, or a hub id)."""
    from ntil_ds.data.processor import tokenizer_of

    source = getattr(processor, "source_dir", None) or tokenizer_of(processor).name_or_path
    return str(Path(source).resolve()) if Path(source).is_dir() else str(source)


def processor_digest(processor) -> str:
    """sha256 of the processor as it is loaded, not of its folder: its class and modality (Llama 4 loads
    from the same files as a tokenizer without torchvision and as an image processor with it; a cache of
    one fails the other), its chat templates, and every file its ``save_pretrained`` writes. Those are
    written from memory (tokenizer.json from the tokenizer's backend), so an in-memory change such as
    ``fix_mistral_regex``'s digit split is in the digest although no file changed; and nothing else of
    the folder is read (a Hub clone's ``.git/lfs`` holds the weights). Milliseconds for the tiny
    processors, a fraction of a second for a 150k-token vocabulary; the main rank computes it
    (``load_dataset``)."""
    import tempfile

    from ntil_ds.data.processor import is_multimodal, tokenizer_of

    digest = hashlib.sha256()
    kind = type(processor)
    digest.update(f"{kind.__module__}.{kind.__qualname__}\0multimodal={is_multimodal(processor)}\0".encode())
    digest.update(json.dumps(getattr(processor, "chat_template", None) or "").encode())
    digest.update(json.dumps(tokenizer_of(processor).chat_template or "").encode())
    with tempfile.TemporaryDirectory() as folder:
        processor.save_pretrained(folder)
        for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(folder)).encode() + b"\0")
            update_with_file(digest, file)
    return digest.hexdigest()


def cache_key(source, processor, max_seq_len: int, on_bad_sample: str) -> tuple[dict, int]:
    """What a cache must have been built from to be used (compared field by field: the log names the
    fields that differ), and the source's line count. It reads every byte of the data (its sha256), so
    with several ranks the main rank computes it and shares it (``load_dataset``). The path is the
    resolved one, as in the folder's name (`slot_name`): one file spelt two ways is one cache, not two
    jobs rebuilding each other's."""
    import tokenizers
    import transformers

    data_digest, lines = source.digest()
    key = {
        "data_path": data_identity(source.path),
        "encoding_version": ENCODING_VERSION,
        "data_sha256": data_digest,
        "processor_sha256": processor_digest(processor),
        "max_seq_len": max_seq_len,
        "on_bad_sample": on_bad_sample,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    return key, lines


def cache_root(data_path: Path, cache_dir: str | Path | None, output_dir: str | Path | None) -> Path:
    """The folder caches live in: ``cache_dir`` when given; else ``.ntil_cache`` beside the data file (every
    run on that data shares it: requeues, resumes, grid jobs), or under ``output_dir`` when the data
    folder cannot be written to (a read-only data set)."""
    if cache_dir:
        root = Path(cache_dir)
        root.mkdir(parents=True, exist_ok=True)
        return root
    candidates = [data_path.resolve().parent / CACHE_FOLDER]
    if output_dir:
        candidates.append(Path(output_dir) / CACHE_FOLDER)
    for root in candidates:
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".probe-{uuid.uuid4().hex}"
            probe.touch()
            probe.unlink()
            return root
        except OSError:
            continue
    raise OSError(
        f"no writable folder for the data cache of {data_path} (tried {', '.join(map(str, candidates))}); "
        "set data.cache_dir, or data.cache=false"
    )


def data_identity(data_path: str | Path) -> str:
    """The data file as the cache knows it: its folder resolved (``a/../b``, a relative path, a symlinked
    folder are one file), its own name not (a symlink to the file from another folder is other data: its
    image paths are relative to that folder)."""
    path = Path(data_path)
    return str(path.absolute().parent.resolve() / path.name)


def slot_name(data_path: Path, processor, max_seq_len: int, on_bad_sample: str) -> str:
    """The cache folder's name: one per data file, processor, max_seq_len and on_bad_sample, so a change
    of content in any of them rebuilds that one folder (and the log can say what changed)."""
    ident = json.dumps([data_identity(data_path), processor_source(processor), max_seq_len, on_bad_sample])
    return f"{data_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


@dataclass
class CacheArrays:
    """The mapped arrays of one cache folder (read-only), and its manifest."""

    folder: Path
    manifest: dict
    arrays: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def __getstate__(self) -> dict:
        # Loader workers started by spawn get the folder, not a pickled copy of every array.
        return {"folder": self.folder, "manifest": self.manifest}

    def __setstate__(self, state: dict) -> None:
        self.folder, self.manifest = state["folder"], state["manifest"]
        self.arrays = _map(self.folder, self.manifest)


def check(folder: Path, key: dict) -> tuple[CacheArrays | None, str]:
    """The folder's arrays mapped when it is a complete cache built for `key`; else None and why not."""
    if not folder.is_dir():
        return None, "missing"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        built_for = manifest["key"]
        lengths = {name: int(spec["length"]) for name, spec in manifest["arrays"].items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"its manifest is unreadable ({type(error).__name__}: {error})"
    changed = [
        f"{name} ({built_for.get(name)!r} -> {value!r})"
        for name, value in key.items()
        if built_for.get(name) != value
    ]
    if changed:
        return None, "it was built for other inputs: " + ", ".join(changed)
    expected = ARRAYS | (TEXT_ARRAYS if manifest.get("multimodal") else {})
    for name, dtype in expected.items():
        path = folder / f"{name}.bin"
        if name not in lengths or manifest["arrays"][name].get("dtype") != dtype:
            return None, f"its manifest does not describe {name}.bin"
        size = path.stat().st_size if path.is_file() else None
        expected_size = lengths[name] * np.dtype(dtype).itemsize
        if size != expected_size:
            return (
                None,
                f"{name}.bin is {'missing' if size is None else f'{size} bytes'}, not {expected_size}",
            )
    arrays = CacheArrays(folder, manifest, _map(folder, manifest))
    problem = _inconsistency(arrays, manifest)
    return (None, problem) if problem else (arrays, "")


def _map(folder: Path, manifest: dict) -> dict[str, np.ndarray]:
    return {
        name: np.memmap(folder / f"{name}.bin", dtype=spec["dtype"], mode="r", shape=(int(spec["length"]),))
        if int(spec["length"])
        else np.zeros(0, dtype=spec["dtype"])  # mmap cannot map an empty file
        for name, spec in manifest["arrays"].items()
    }


def _inconsistency(arrays: CacheArrays, manifest: dict) -> str:
    count = int(manifest["num_samples"])
    offsets = arrays["offsets"]
    if len(offsets) != count + 1 or len(arrays["lines"]) != count or len(arrays["line_offsets"]) != count:
        return f"its per-sample arrays do not hold {count} samples"
    if offsets[0] != 0 or offsets[-1] != len(arrays["input_ids"]) or len(arrays["targets"]) != offsets[-1]:
        return "its offsets do not span its tokens"
    return ""


class SlotLock:
    """The flock on ``<root>/<slot>.lock``: exclusive for a build, shared for a check-and-map. One open
    file per holder (flocks of two open files conflict, in one process too); released on `release`, on
    leaving the ``with``, or when the process ends (a killed builder frees it)."""

    def __init__(self, root: Path, slot: str) -> None:
        self.file = open(root / f"{slot}.lock", "a+b")  # noqa: SIM115 (closed by __exit__)

    def take(self, exclusive: bool, wait: bool = True) -> bool:
        """Take the lock (a shared one turns into the exclusive one); False when ``wait=False`` and
        another process holds it in a conflicting mode."""
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(self.file, mode if wait else mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held(self, exclusive: bool) -> Iterator[None]:
        self.take(exclusive)
        try:
            yield
        finally:
            self.release()

    def __enter__(self) -> SlotLock:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


class CacheWriter:
    """Streams arrays into a temporary folder beside ``final``; :meth:`commit` puts it in place atomically.

    Use as a context manager: an exception (a bad line with on_bad_sample=error) removes the folder."""

    def __init__(self, final: Path, names: dict[str, str]) -> None:
        self.final, self.names = final, names
        self.tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.tmp.mkdir()
        self.files = {name: (self.tmp / f"{name}.bin").open("wb") for name in names}
        self.lengths = dict.fromkeys(names, 0)

    def append(self, name: str, values: np.ndarray | list | bytes) -> None:
        data = values if isinstance(values, bytes) else np.asarray(values, dtype=self.names[name]).tobytes()
        self.files[name].write(data)
        self.lengths[name] += len(data) // np.dtype(self.names[name]).itemsize

    def commit(self, manifest: dict) -> None:
        manifest = {
            **manifest,
            "arrays": {n: {"dtype": d, "length": self.lengths[n]} for n, d in self.names.items()},
        }
        for file in self.files.values():
            file.flush()
            os.fsync(file.fileno())
            file.close()
        with (self.tmp / MANIFEST).open("w") as file:  # last: a folder with a manifest was written whole
            json.dump(manifest, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        _fsync_dir(self.tmp)
        old = None
        if self.final.exists():  # a stale cache: moved aside first (a folder cannot be renamed over another)
            old = self.final.with_name(f".{self.final.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(self.final, old)
        os.rename(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)  # processes that mapped it keep their pages

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        for file in self.files.values():
            file.close()
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)


def remove_leftovers(final: Path) -> None:
    """Temporary and old folders that a killed builder left (call holding the exclusive lock)."""
    for path in final.parent.glob(f".{final.name}.*"):
        if path.is_dir() and (".tmp-" in path.name or ".old-" in path.name):
            shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
