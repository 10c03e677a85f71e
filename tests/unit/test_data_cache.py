"""The data cache (ntil_ds/data/cache.py, cached_dataset.py): the same samples as the uncached dataset,
and the rules that make a cache valid: data content, processor files, a concurrent build, a torn file."""

import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from ntil_ds.data import (
    BadSample,
    ConversationDataset,
    DataError,
    ResumableDistributedSampler,
    load_processor,
)
from ntil_ds.data import cache as cache_module
from ntil_ds.data.cache import CACHE_FOLDER, MANIFEST, slot_name
from ntil_ds.data.cached_dataset import CachedConversationDataset, load_dataset
from ntil_ds.data.steps import StepBatches
from ntil_ds.tiny import build_tiny_model_folder

KINDS = ("qwen2", "qwen2_vl", "gemma3")  # text-only; image tokens only; text around the image tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny_model_folder(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def processors(folders):
    return {kind: load_processor(folder) for kind, folder in folders.items()}


def _turns(question, answer, images=()):
    user = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": question}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _text_rows(n):
    """Arithmetic lines with every kind of line the checks treat: ShareGPT, multi-turn, a long one that
    is cut, one too long to keep, bad lines of each kind, a blank line, non-ASCII text."""
    rows = []
    for i in range(n):
        rows.append({"messages": _turns(f"What is {i} + {2 * i}? ü", str(3 * i))})
        if i % 7 == 3:
            rows.append(
                {
                    "conversations": [
                        {"from": "human", "value": f"{i}*2?"},
                        {"from": "gpt", "value": str(2 * i)},
                    ]
                }
            )
        if i % 11 == 5:
            system = {"role": "system", "content": "Answer with digits."}
            rows.append({"messages": [system, *_turns("1+1?", "2"), *_turns("2+2?", "4")]})
    rows += [
        {
            "messages": [*_turns("short?", "1"), *_turns("word " * 200 + "?", "2")]
        },  # cut: the second answer goes
        {"messages": _turns("word " * 300 + "?", "7")},  # too long, nothing left: skipped
        "not json",
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": _turns("empty?", " ")},
        "",
        {"rows": []},
    ]
    return rows


def _image_rows(folder, n):
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 48), (200, 20, 20)).save(folder / "red.png")
    Image.new("RGB", (100, 60), (20, 20, 200)).save(folder / "blue.png")
    (folder / "broken.png").write_bytes(b"\x89PNG not an image")
    rows = []
    for i in range(n):
        images = [["red.png"], ["blue.png"], ["red.png", "blue.png"], []][i % 4]
        rows.append({"messages": _turns(f"How many? {i}", str(i), images)})
    rows.append(
        {
            "conversations": [
                {"from": "human", "value": "<image>\nTime?"},
                {"from": "gpt", "value": "10:42"},
            ],
            "image": "blue.png",
        }
    )
    rows += [
        {"messages": _turns("gone?", "1", ["missing.png"])},
        {"messages": _turns("broken?", "1", ["broken.png"])},
    ]
    return rows


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows)
    )
    return path


def _assert_same_samples(cached, plain):
    assert len(cached) == len(plain) > 0
    assert cached.report.summary() == plain.report.summary()
    assert cached.report.examples == plain.report.examples
    assert list(cached.lengths()) == [plain.num_tokens(i) for i in range(len(plain))]
    for i in range(len(plain)):
        got, want = cached[i], plain[i]
        assert got.keys() == want.keys(), i
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (i, key)
        assert cached.num_tokens(i) == plain.num_tokens(i)
        assert cached.conversations[i] == plain.conversations[i]


@pytest.mark.parametrize("kind", KINDS)
def test_cached_samples_equal_uncached_field_by_field(tmp_path, processors, kind):
    processor = processors[kind]
    rows = _text_rows(40) if kind == "qwen2" else _image_rows(tmp_path / "data", 12)
    path = _write(tmp_path / "data" / "train.jsonl", rows)
    plain = ConversationDataset(path, processor, max_seq_len=128, on_bad_sample="skip")
    assert plain.report.num_skipped and (kind != "qwen2" or plain.report.truncated)  # the set tests them
    built = CachedConversationDataset(path, processor, max_seq_len=128, on_bad_sample="skip")
    assert built.cache_status == "built"
    _assert_same_samples(built, plain)
    reused = CachedConversationDataset(path, processor, max_seq_len=128, on_bad_sample="skip")
    assert reused.cache_status == "reused"
    _assert_same_samples(reused, plain)
    assert (tmp_path / "data" / CACHE_FOLDER).is_dir()  # default: beside the data file
    assert reused.conversations[-2:] == plain.conversations[-2:] and reused[-1].keys() == plain[-1].keys()


def test_skip_report_from_the_cache_is_the_same_and_logged(tmp_path, processors, caplog):
    path = _write(tmp_path / "train.jsonl", _text_rows(5))
    plain = ConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    CachedConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        reused = CachedConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    assert reused.cache_status == "reused"
    assert (
        dict(reused.report.skipped)
        == dict(plain.report.skipped)
        == {
            "bad_schema": 1,
            "empty_answer": 1,
            "malformed_json": 1,
            "no_assistant_turn": 1,
            "too_long": 1,
        }
    )
    assert (reused.report.kept, reused.report.truncated) == (plain.report.kept, plain.report.truncated)
    assert plain.report.summary() in caplog.text  # the warning of a reused cache, as of a fresh read


def test_a_bad_line_with_on_bad_sample_error_leaves_no_cache(tmp_path, processors):
    path = _write(tmp_path / "train.jsonl", [{"messages": _turns("1+1?", "2")}, "not json"])
    with pytest.raises(BadSample, match=r"train.jsonl:2: not valid JSON.*on_bad_sample=skip"):
        CachedConversationDataset(path, processors["qwen2"], max_seq_len=128)
    assert [p.name for p in (tmp_path / CACHE_FOLDER).iterdir() if not p.name.endswith(".lock")] == []


def test_data_changed_at_the_same_size_and_mtime_is_rebuilt(tmp_path, processors, caplog):
    path = _write(tmp_path / "train.jsonl", _text_rows(20))
    first = CachedConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    stat = path.stat()
    changed = path.read_text().replace('"content": "57"', '"content": "58"', 1)  # 19 + 38: one digit
    assert changed != path.read_text()
    path.write_text(changed)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    with caplog.at_level(logging.INFO):
        second = CachedConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    assert second.cache_status.startswith("rebuilt because it was built for other inputs: data_sha256")
    assert second.cache_status in caplog.text
    plain = ConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    _assert_same_samples(second, plain)
    assert any(not torch.equal(first[i]["input_ids"], plain[i]["input_ids"]) for i in range(len(plain)))


def test_a_changed_tokenizer_file_is_rebuilt(tmp_path, folders):
    folder = shutil.copytree(folders["qwen2"], tmp_path / "model")
    path = _write(tmp_path / "train.jsonl", _text_rows(5))
    CachedConversationDataset(path, load_processor(folder), max_seq_len=128, on_bad_sample="skip")
    # A new special token (added_tokens in tokenizer.json): the template and the config files stay as
    # they were, and a line that holds the token's text now encodes differently.
    tokenizer_file = folder / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    new_id = len(load_processor(folder))
    spec["added_tokens"].append(
        {"id": new_id, "content": "What is", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
    )  # fmt: skip
    tokenizer_file.write_text(json.dumps(spec))
    processor = load_processor(folder)
    assert processor.convert_tokens_to_ids("What is") == new_id
    rebuilt = CachedConversationDataset(path, processor, max_seq_len=128, on_bad_sample="skip")
    assert rebuilt.cache_status.startswith("rebuilt because it was built for other inputs: processor_sha256")
    _assert_same_samples(rebuilt, ConversationDataset(path, processor, max_seq_len=128, on_bad_sample="skip"))


def test_a_tokenizer_changed_in_memory_is_rebuilt(tmp_path):
    """Mistral Small 3.1's tokenizer.json groups digits; the data pipeline splits them in memory
    (fix_mistral_regex): no file changes, yet the cache built before the fix holds grouped digit
    labels. The key is the tokenizer as loaded, so the fixed one rebuilds and gets one digit a token."""
    from transformers import AutoTokenizer

    from ntil_ds.data.processor import fix_mistral_regex

    folder = build_tiny_model_folder("mistral3", tmp_path / "mistral3")
    path = _write(
        tmp_path / "train.jsonl", [{"messages": _turns(f"{i} * 37?", str(i * 37))} for i in range(60, 80)]
    )
    grouped = AutoTokenizer.from_pretrained(folder)
    before = CachedConversationDataset(path, grouped, 128, "skip")
    assert fix_mistral_regex(grouped, folder)  # the same object, changed in memory
    after = CachedConversationDataset(path, grouped, 128, "skip")
    assert after.cache_status.startswith("rebuilt because it was built for other inputs: processor_sha256")
    assert after.cache.folder == before.cache.folder
    digits = [
        t for t in grouped.convert_ids_to_tokens(after[0]["input_ids"].tolist()) if t.strip("▁").isdigit()
    ]
    assert digits and all(len(t.strip("▁")) == 1 for t in digits), digits
    _assert_same_samples(after, ConversationDataset(path, grouped, max_seq_len=128, on_bad_sample="skip"))


def test_the_processor_kind_and_the_path_spelling_are_in_the_key(tmp_path, folders, monkeypatch):
    """One folder loaded as its image processor and as its tokenizer alone (Llama 4 loads either way from
    the same files, with and without torchvision): a cache of one is never the other's (it would fail at
    the first sample); one data file spelt two ways is one cache, reused, not rebuilt."""
    from ntil_ds.data.processor import tokenizer_of

    path = _write(tmp_path / "data" / "train.jsonl", _image_rows(tmp_path / "data", 8)[:8])
    processor = load_processor(folders["qwen2_vl"])
    text_only = CachedConversationDataset(path, tokenizer_of(processor), 128, "skip")
    assert text_only.cache_status == "built" and not text_only.multimodal
    full = CachedConversationDataset(path, processor, 128, "skip")
    assert full.cache.folder == text_only.cache.folder  # one slot: the same folder, the same settings
    assert full.cache_status.startswith("rebuilt because it was built for other inputs: processor_sha256")
    _assert_same_samples(full, ConversationDataset(path, processor, max_seq_len=128, on_bad_sample="skip"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    spellings = (tmp_path / "elsewhere" / ".." / "data" / "train.jsonl", tmp_path / "alias" / "train.jsonl")
    for spelling in (*spellings, "data/train.jsonl"):
        again = CachedConversationDataset(spelling, processor, 128, "skip")
        assert again.cache_status == "reused" and again.cache.folder == full.cache.folder, spelling
    # A link to the file from another folder is other data: its images are looked for in that folder.
    (tmp_path / "elsewhere" / "train.jsonl").symlink_to(path)
    linked = CachedConversationDataset(tmp_path / "elsewhere" / "train.jsonl", processor, 128, "skip")
    assert linked.cache_status == "built" and linked.report.skipped["missing_image"] == 6


def test_the_processor_digest_reads_no_file_of_the_folder_but_what_the_processor_is(
    tmp_path, folders, monkeypatch
):
    """A Hub clone holds the weights under .git/lfs and other files beside the tokenizer: none of them is
    read for the key (they would cost a walk through gigabytes on every start), while a change of what the
    processor is (its image size) changes the key."""
    folder = shutil.copytree(folders["qwen2_vl"], tmp_path / "model")
    digest = cache_module.processor_digest(load_processor(folder))
    blob = folder / ".git" / "lfs" / "objects" / "ab" / "cd" / "abcd"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(os.urandom(1 << 20))
    (folder / "README.md").write_text("a model card")
    (folder / "model.safetensors").write_bytes(b"weights")
    opened = []
    read = cache_module.update_with_file
    monkeypatch.setattr(cache_module, "update_with_file", lambda d, f: opened.append(str(f)) or read(d, f))
    assert cache_module.processor_digest(load_processor(folder)) == digest
    assert opened and not [f for f in opened if f.startswith(str(folder))], opened  # its own saved copy
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["max_pixels"] = config.get("max_pixels", 12845056) // 2
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    assert cache_module.processor_digest(load_processor(folder)) != digest


def _cache_files(folder):
    return {p.name for p in folder.iterdir()}


@pytest.mark.parametrize(
    "tear, reason",
    [
        (lambda f: _truncate(f / "targets.bin"), r"targets.bin is \d+ bytes, not \d+"),
        (lambda f: (f / "input_ids.bin").unlink(), "input_ids.bin is missing"),
        (lambda f: (f / MANIFEST).write_text('{"key": '), "its manifest is unreadable"),
    ],
    ids=["truncated", "missing", "manifest"],
)
def test_a_torn_cache_is_rebuilt_and_the_log_says_why(tmp_path, processors, caplog, tear, reason):
    path = _write(tmp_path / "train.jsonl", _text_rows(10))
    plain = ConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    first = CachedConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    tear(first.cache.folder)
    with caplog.at_level(logging.INFO):
        again = CachedConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    assert again.cache_status.startswith("rebuilt because ")
    assert re.search(reason, again.cache_status) and again.cache_status in caplog.text
    _assert_same_samples(again, plain)
    leftovers = [p.name for p in first.cache.folder.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers


def _truncate(file):
    with file.open("r+b") as handle:
        handle.truncate(file.stat().st_size - 4)


def _open_in_child(folder, path, cache_dir, start, results):
    try:
        processor = load_processor(folder)
        start.wait()  # both children check the cache at the same moment: neither finds one
        dataset = CachedConversationDataset(path, processor, 128, "skip", cache_dir=cache_dir)
        digest = hashlib.sha256()
        for name in sorted(dataset.cache.arrays):
            digest.update(np.ascontiguousarray(dataset.cache[name]).tobytes())
        results.put((dataset.cache_status, digest.hexdigest(), len(dataset)))
    except BaseException as error:  # reported, so the test fails with it rather than waiting
        results.put((f"failed: {error!r}", "", 0))
        raise


def test_a_concurrent_build_builds_once_and_both_map_the_same_complete_cache(tmp_path, folders):
    path = _write(tmp_path / "train.jsonl", _text_rows(300))  # long enough for two builds to overlap
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    args = (folders["qwen2"], path, tmp_path / "cache", start, results)
    children = [context.Process(target=_open_in_child, args=args) for _ in range(2)]
    for child in children:
        child.start()
    got = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    statuses = sorted(status for status, _, _ in got)
    assert statuses == ["built", "reused"], statuses  # without the lock: both build
    assert got[0][1:] == got[1][1:]
    plain = ConversationDataset(path, load_processor(folders["qwen2"]), max_seq_len=128, on_bad_sample="skip")
    assert got[0][2] == len(plain)
    folders_left = [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(folders_left) == 1 and not folders_left[0].startswith("."), folders_left


def test_a_read_only_data_folder_falls_back_to_output_dir(tmp_path, processors):
    path = _write(tmp_path / "data" / "train.jsonl", _text_rows(3))
    # (tests run as root, whom chmod does not stop: a file where the cache folder would go fails the same way)
    (tmp_path / "data" / CACHE_FOLDER).write_text("")
    dataset = CachedConversationDataset(path, processors["qwen2"], 128, "skip", output_dir=tmp_path / "run")
    assert dataset.cache.folder.parent == tmp_path / "run" / CACHE_FOLDER


def test_load_dataset_without_cache_is_todays_dataset(tmp_path, processors):
    path = _write(tmp_path / "train.jsonl", _text_rows(3))
    assert type(load_dataset(path, processors["qwen2"], 128, "skip", cache=False)) is ConversationDataset
    cached = load_dataset(path, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "c")
    assert isinstance(cached, CachedConversationDataset)


def test_ranks_meet_once_with_the_main_rank_holding_the_lock(tmp_path, processors, monkeypatch):
    """The main rank enters the collective holding the build lock (the others then wait on the lock, not
    in a collective), and with the cache's key, which it alone computed (every byte of the data hashed
    once, not once per rank); it enters it exactly once, also when the data is bad."""
    path = _write(tmp_path / "train.jsonl", _text_rows(3))
    lock = tmp_path / "c" / f"{slot_name(path, processors['qwen2'], 128, 'skip')}.lock"
    held, shared = [], []

    def share(identity):
        with lock.open("a+b") as file:
            try:
                fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        shared.append(identity)
        return shared[0]  # the main rank's, as broadcast_from_main gives every rank

    hashed = []
    digest = cache_module.file_digest
    monkeypatch.setattr(cache_module, "file_digest", lambda p: hashed.append(p) or digest(p))
    main = load_dataset(path, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "c", share=share)
    assert held == [True] and main.cache_status == "built"
    key, lines = shared[0]
    assert key == main.cache.manifest["key"] and lines == len(_text_rows(3)) and len(hashed) == 1
    other = load_dataset(
        path, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "c", share=share, is_main=False
    )
    assert held == [True, False] and other.cache_status == "reused"
    assert len(hashed) == 1  # the other rank used the main rank's key
    # The same file again (data.eval_file = data.train_file): the cache checks, so the main rank meets
    # the others without the exclusive lock; holding it, it would wait in the collective for a rank that
    # still waits for its shared lock on this slot from the dataset before (a deadlock seen on 2 ranks).
    again = load_dataset(path, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "c", share=share)
    assert held == [True, False, False] and again.cache_status == "reused"
    calls = []
    with pytest.raises(DataError, match="data file not found"):  # before any lock: the others get None
        load_dataset(tmp_path / "nope.jsonl", processors["qwen2"], 128, "skip", share=calls.append)
    bad = _write(tmp_path / "bad.jsonl", ["not json"])
    with pytest.raises(BadSample):  # while building
        load_dataset(bad, processors["qwen2"], 128, "error", share=calls.append)
    assert calls[0] is None and len(calls) == 2 and calls[1][0]["data_path"] == str(bad.resolve())


def test_the_mapped_arrays_pickle_as_their_folder(tmp_path, processors):
    """Loader workers started by spawn get the dataset pickled: the folder travels, not the arrays."""
    path = _write(tmp_path / "train.jsonl", _text_rows(30))
    dataset = CachedConversationDataset(path, processors["qwen2"], 128, "skip")
    blob = pickle.dumps(dataset.cache)
    assert len(blob) < 4096 < dataset.cache["input_ids"].nbytes
    again = pickle.loads(blob)
    assert all(np.array_equal(again[name], dataset.cache[name]) for name in dataset.cache.arrays)


def test_the_main_rank_sees_the_encoding_progress_with_time_left(tmp_path, processors, capsys):
    path = _write(tmp_path / "train.jsonl", _text_rows(30))
    capsys.readouterr()
    load_dataset(path, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "c", is_main=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith("encoding train.jsonl") for line in err)  # whole lines: no redraws
    assert "<00:00" in err[-1] and "line/s" in err[-1]
    load_dataset(path, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "c", is_main=False)
    assert capsys.readouterr().err == ""  # other ranks, and a reused cache, show nothing


def test_packing_plans_the_same_steps_from_the_cached_lengths(tmp_path, processors):
    path = _write(tmp_path / "train.jsonl", _text_rows(40))
    plain = ConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")
    cached = CachedConversationDataset(path, processors["qwen2"], max_seq_len=128, on_bad_sample="skip")

    def plans(dataset, rank):
        sampler = ResumableDistributedSampler(len(dataset), dp_rank=rank, dp_size=2, seed=3)
        steps = StepBatches(dataset, sampler, list, samples_per_rank=6, micro_batch_size=1, max_tokens=128)
        return [steps.step_groups(k) for k in range(8)]  # 8 steps x 12 samples: past an epoch

    for rank in (0, 1):
        assert plans(cached, rank) == plans(plain, rank)


def test_a_new_encoding_version_or_other_settings_never_reuse_a_cache(tmp_path, processors, monkeypatch):
    path = _write(tmp_path / "train.jsonl", _text_rows(5))
    first = CachedConversationDataset(path, processors["qwen2"], 128, "skip")
    other_length = CachedConversationDataset(path, processors["qwen2"], 64, "skip")
    assert other_length.cache_status == "built" and other_length.cache.folder != first.cache.folder
    assert CachedConversationDataset(path, processors["qwen2"], 128, "skip").cache_status == "reused"
    monkeypatch.setattr(cache_module, "ENCODING_VERSION", cache_module.ENCODING_VERSION + 1)
    bumped = CachedConversationDataset(path, processors["qwen2"], 128, "skip")
    assert bumped.cache_status.startswith("rebuilt because it was built for other inputs: encoding_version")


# -- the first build split over processes (ntil_ds/data/parallel_build.py) ---------------------------


def _spread_rows(n):
    """Good lines with bad ones of several kinds spread over the file (every range of a split gets some,
    in an order where a reason's first line and the first five messages cross ranges)."""
    rows = [{"messages": _turns(f"What is {i} + {2 * i}?", str(3 * i))} for i in range(n)]
    bad = ["not json", {"messages": _turns("empty?", " ")}, {"rows": []}, "not json either",
           {"messages": [{"role": "user", "content": "no answer"}]}, {"messages": _turns("e?", " ")}, "{"]  # fmt: skip
    for j, row in enumerate(bad):
        rows.insert((j + 1) * len(rows) // (len(bad) + 1), row)
    return rows


def _folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _wait_for_a_helper(monkeypatch_or_none=None):
    """Patch PartedBuild.encode so the builder starts its first range only once another process has
    claimed one: each process's share of the build is then known, not a race."""
    import time as clock

    from ntil_ds.data.parallel_build import PartedBuild

    original = PartedBuild.encode

    def encode(self, k, on_lines=None):
        if k == 0:
            deadline = clock.monotonic() + 120
            while not any(self.folder.glob("part-*.claim")) or len(list(self.folder.glob("*.claim"))) < 2:
                assert clock.monotonic() < deadline, "no other process claimed a range"
                clock.sleep(0.02)
        return original(self, k, on_lines)

    if monkeypatch_or_none is None:
        PartedBuild.encode = encode
    else:
        monkeypatch_or_none.setattr(PartedBuild, "encode", encode)


def test_a_pool_build_is_the_serial_build_byte_for_byte(tmp_path, processors, folders, monkeypatch):
    """One rank, data.encode_workers=2: a spawned worker encodes ranges (the Qwen2-VL processor, which
    does not pickle, loaded again there from its folder); the cache equals the serial one file by file."""
    rows = _image_rows(tmp_path / "data", 40)
    rows[10:10] = rows[-2:]  # the bad image lines also early
    path = _write(tmp_path / "data" / "train.jsonl", rows)
    serial = CachedConversationDataset(path, processors["qwen2_vl"], 128, "skip", cache_dir=tmp_path / "s",
                                       encode_workers=1)  # fmt: skip
    assert serial.encoded_ranges is None
    _wait_for_a_helper(monkeypatch)
    pooled = CachedConversationDataset(path, processors["qwen2_vl"], 128, "skip", cache_dir=tmp_path / "p",
                                       encode_workers=2)  # fmt: skip
    done, total = pooled.encoded_ranges
    assert total == 8 and 0 < done < total  # the worker encoded the others
    assert _folder_bytes(pooled.cache.folder) == _folder_bytes(serial.cache.folder)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == sorted(
        p.name for p in (tmp_path / "s").iterdir()
    )
    _assert_same_samples(pooled, ConversationDataset(path, processors["qwen2_vl"], 128, on_bad_sample="skip"))


LINUX_PROC = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="a zombie is told by /proc")
CLAIM_AND_DIE = """
import json, os, pathlib, signal, sys
from ntil_ds.data.parallel_build import PartedBuild
folder = pathlib.Path(sys.argv[1])
ticket = json.loads((folder / "ticket.json").read_text())
assert PartedBuild(folder, ticket, None, ticket["names"])._claim(int(sys.argv[2]))
os.kill(os.getpid(), signal.SIGKILL)  # killed (OOM, SIGKILL) before encoding its range
"""


def _zombie(pid):
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, and not reaped: a zombie
    os.kill(pid, 0)  # which os.kill still finds


@LINUX_PROC
def test_alive_is_false_for_a_zombie_and_for_pid_0(tmp_path):
    from ntil_ds.data.parallel_build import _alive

    sleep = tmp_path / "a) Z (b"  # the name in /proc/<pid>/stat's "(comm)": parentheses, a state letter
    sleep.symlink_to(shutil.which("sleep"))
    child = subprocess.Popen([str(sleep), "60"])
    try:
        assert _alive(child.pid) and _alive(os.getpid())
        child.kill()
        _zombie(child.pid)
        assert not _alive(child.pid)
        assert not _alive(0) and not _alive(-1)  # os.kill(0, 0) signals this process group: succeeds
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("claimant", [pytest.param("killed", marks=LINUX_PROC), "empty claim"])
def test_the_builder_encodes_the_range_of_a_dead_claimant(tmp_path, processors, claimant):
    """A claimant killed mid-build (OOM, SIGKILL) is a zombie until its parent waits for it, and os.kill
    still finds it; a claim with no pid in it (its claimant killed between creating and writing it) read
    as pid 0, which os.kill finds too (the process group). The builder must take either as dead, encode
    that range itself, and commit the serial build's cache byte for byte, not wait forever: the build
    runs in a thread, bounded."""
    from ntil_ds.data.parallel_build import parts_folder

    path = _write(tmp_path / "train.jsonl", _spread_rows(80))
    serial = CachedConversationDataset(path, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "s",
                                       encode_workers=1)  # fmt: skip
    parts = parts_folder(tmp_path / "c", slot_name(path, processors["qwen2"], 128, "skip"))
    children, result = [], []

    def dead_claimant():  # the ticket is out; the builder has not claimed a range yet
        if claimant == "empty claim":
            (parts / "part-00003.claim").write_text("")
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # this ntil_ds
        children.append(subprocess.Popen([sys.executable, "-c", CLAIM_AND_DIE, str(parts), "3"], env=env))
        _zombie(children[0].pid)  # a child of this process, which waits for it only after the build
        assert (parts / "part-00003.claim").read_text() == str(children[0].pid)

    def build():  # a second rank that never comes: the builder (the main rank) encodes every range
        try:
            dataset = CachedConversationDataset(
                path,
                processors["qwen2"],
                128,
                "skip",
                cache_dir=tmp_path / "c",
                ranks=2,
                on_locked=dead_claimant,
            )
            result.append(dataset)
        except BaseException as error:
            result.append(error)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(timeout=60)
    try:
        if thread.is_alive():  # stop the builder (it reads error.json), then fail
            (parts / "error.json").write_text(json.dumps({"kind": "other", "message": "timeout", "pid": 0}))
            thread.join(timeout=30)
            pytest.fail("the builder waits for a dead claimant")
    finally:
        for child in children:  # none left behind, a zombie neither
            child.kill()
            assert child.wait() == -signal.SIGKILL
    (built,) = result
    assert not isinstance(built, BaseException), built
    assert built.cache_status == "built" and built.encoded_ranges == (8, 8)  # range 3 too
    assert _folder_bytes(built.cache.folder) == _folder_bytes(serial.cache.folder)
    assert not parts.exists()


def _broadcast(obj):
    """What the trainer passes as load_dataset's `share` (dist.broadcast_from_main)."""
    from ntil_ds.dist import broadcast_from_main

    return broadcast_from_main(obj)


def _rank(rank, store, folder, files, cache_dir, results):
    """One of two gloo ranks calling load_dataset as the trainer does, on each of `files` in turn."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))  # fmt: skip
        if rank == 0:
            _wait_for_a_helper()
        processor = load_processor(folder)
        for path, rule in files:
            try:
                data = load_dataset(path, processor, 128, rule, cache_dir=cache_dir, is_main=rank == 0,
                                    share=_broadcast, ranks=2)  # fmt: skip
                results.put((rank, str(path), data.cache_status, data.encoded_ranges, None))
            except DataError as error:
                results.put((rank, str(path), "failed", None, str(error)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as error:
        results.put((rank, "", "crashed", None, repr(error)))
        raise


def test_two_ranks_share_the_build_and_a_bad_line_on_either_ends_both(tmp_path, folders, processors):
    """Two real processes (gloo): the build is split between them and equals the serial one byte for
    byte; a bad line (on_bad_sample=error) in the other rank's range, or in the main rank's, ends both
    ranks with that line's error within a bounded time, and leaves no cache."""
    good = _write(tmp_path / "good.jsonl", _spread_rows(400))
    rows = [{"messages": _turns(f"{i}+1?", str(i + 1))} for i in range(400)]
    helper_bad = _write(tmp_path / "bad1.jsonl", [*rows[:75], "not json", *rows[75:]])  # range 1 of 8
    main_bad = _write(tmp_path / "bad0.jsonl", ["not json", *rows])  # range 0: the main rank's
    files = [(good, "skip"), (helper_bad, "error"), (main_bad, "error")]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    args = (tmp_path / "store", folders["qwen2"], files, tmp_path / "c", results)
    ranks = [context.Process(target=_rank, args=(r, *args)) for r in range(2)]
    for process in ranks:
        process.start()
    got = {}
    try:
        for _ in range(2 * len(files)):
            rank, path, status, share, error = results.get(timeout=240)  # a hang fails here, not in CI's
            assert status != "crashed", error
            got[rank, path] = (status, share, error)
        for process in ranks:
            process.join(timeout=60)
            assert process.exitcode == 0
    finally:
        for process in ranks:  # a rank left waiting must not outlive the test
            if process.is_alive():
                process.terminate()
    (status0, share0, _), (status1, share1, _) = got[0, str(good)], got[1, str(good)]
    assert (status0, status1) == ("built", "reused")
    assert share0[1] == share1[1] == 8 and share0[0] + share1[0] == 8 and share1[0] >= 1
    serial = CachedConversationDataset(good, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "s")
    shared = CachedConversationDataset(good, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "c")
    assert shared.cache_status == "reused" and serial.report.num_skipped == 7
    assert _folder_bytes(shared.cache.folder) == _folder_bytes(serial.cache.folder)
    for path, line in ((helper_bad, 76), (main_bad, 1)):
        for rank in (0, 1):
            status, _, error = got[rank, str(path)]
            assert status == "failed" and f"{path.name}:{line}: not valid JSON" in error, (rank, error)
            assert "on_bad_sample=skip" in error
    left = [p.name for p in (tmp_path / "c").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert left == [shared.cache.folder.name]  # the bad files left no cache


def _slow_ticket():
    """PartedBuild.start a second late: the node's other rank finds no build to help yet, and must not
    then block on the lock (it would encode nothing: the node's build serial)."""
    import time as clock

    from ntil_ds.data.parallel_build import PartedBuild

    start = PartedBuild.start.__func__
    PartedBuild.start = classmethod(lambda cls, *a: clock.sleep(1.0) or start(cls, *a))


def _node_rank(rank, store, folder, path, scratch, results):
    """One of 4 gloo ranks, 2 a "node", each node's data.cache_dir its own folder (a node-local disk)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4,
                                timeout=timedelta(seconds=60))  # fmt: skip
        _wait_for_a_helper()  # whichever rank leads a node's build starts once the other has claimed
        _slow_ticket()  # ...and the other has looked for a build to help long before the ticket is out
        data = load_dataset(path, load_processor(folder), 128, "skip", cache_dir=scratch / f"node{rank // 2}",
                            is_main=rank == 0, share=_broadcast, ranks=2)  # fmt: skip
        results.put((rank, data.cache_status, data.encoded_ranges, None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as error:
        results.put((rank, "crashed", None, repr(error)))
        raise


def test_each_node_builds_its_node_local_cache_with_its_own_ranks(tmp_path, folders, processors):
    """2 "nodes" x 2 ranks (4 gloo processes), data.cache_dir on each node's own disk: the second node's
    cache is built at the same time as the first's, split between its two ranks (the first to find its
    lock free leads, the other helps), not by one rank alone while the job waits in a collective; both
    caches are the serial build byte for byte."""
    path = _write(tmp_path / "train.jsonl", _spread_rows(200))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    args = (tmp_path / "store", folders["qwen2"], path, tmp_path / "scratch", results)
    ranks = [context.Process(target=_node_rank, args=(r, *args)) for r in range(4)]
    for process in ranks:
        process.start()
    try:
        got = {}
        for _ in range(4):
            rank, status, share, error = results.get(timeout=240)  # a hang fails here, not in CI's
            assert status != "crashed", error
            got[rank] = (status, share)
        for process in ranks:
            process.join(timeout=60)
            assert process.exitcode == 0
    finally:
        for process in ranks:
            if process.is_alive():
                process.terminate()
    serial = CachedConversationDataset(path, processors["qwen2"], 128, "skip", cache_dir=tmp_path / "s")
    for node in (0, 1):
        (status_a, share_a), (status_b, share_b) = got[2 * node], got[2 * node + 1]
        assert sorted((status_a, status_b)) == ["built", "reused"], (node, got)
        assert share_a[1] == share_b[1] == 8 and share_a[0] + share_b[0] == 8, (node, got)
        assert min(share_a[0], share_b[0]) >= 1, (node, got)  # both ranks of the node encoded
        (cache,) = (tmp_path / "scratch" / f"node{node}").glob("*/manifest.json")
        assert _folder_bytes(cache.parent) == _folder_bytes(serial.cache.folder)
