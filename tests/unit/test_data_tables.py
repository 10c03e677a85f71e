"""Parquet files, folders of shards and save_to_disk folders (ntil_ds/data/tables.py, sources.py): the
same samples as the same data in JSONL, through the real tiny processors, with the same checks."""

import json
import pickle

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from ntil_ds.data import BadSample, ConversationDataset, DataError, load_processor
from ntil_ds.data.cache import CACHE_FOLDER
from ntil_ds.data.cached_dataset import CachedConversationDataset
from ntil_ds.data.tables import RowImage
from ntil_ds.tiny import build_tiny_model_folder


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(build_tiny_model_folder("qwen2_vl", tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture
def pictures(tmp_path):
    folder = tmp_path / "pictures"
    folder.mkdir()
    Image.new("RGB", (64, 48), (200, 20, 20)).save(folder / "red.png")
    Image.new("RGB", (100, 60), (20, 20, 200)).save(folder / "blue.png")
    return folder


SPECS = [
    (f"How many? {i}", str(i), [["red.png"], ["blue.png"], ["red.png", "blue.png"], []][i % 4])
    for i in range(9)
]


def _jsonl(path, specs):
    rows = []
    for question, answer, images in specs:
        user = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": question}]
        rows.append(
            {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _struct(folder, name, embed):
    """The Hugging Face image struct: the file's bytes (its name kept as the path), or the path alone."""
    return {"bytes": (folder / name).read_bytes(), "path": name} if embed else {"bytes": None, "path": name}


def _table_rows(folder, specs, embed):
    """TRL / Hugging Face layout: {"type": "image"} parts and an `images` column of image structs."""
    rows = []
    for question, answer, images in specs:
        user = [*({"type": "image", "text": None} for _ in images), {"type": "text", "text": question}]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ],
                "images": [_struct(folder, i, embed) for i in images],
            }
        )
    return rows


def _parquet(path, rows, row_group_size=4):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _assert_same(got, want):
    assert len(got) == len(want) > 0
    assert (got.report.kept, got.report.skipped) == (want.report.kept, want.report.skipped)
    for i in range(len(want)):
        a, b = got[i], want[i]
        assert a.keys() == b.keys() and ("pixel_values" in a) == (i % 4 != 3), i
        for key in b:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (i, key)
        assert got.conversations[i].messages == want.conversations[i].messages


@pytest.mark.parametrize("embed", [True, False], ids=["bytes", "paths"])
def test_parquet_equals_jsonl_sample_by_sample(tmp_path, pictures, processor, embed):
    want = ConversationDataset(_jsonl(pictures / "train.jsonl", SPECS), processor, max_seq_len=256)
    path = _parquet(pictures / "train.parquet", _table_rows(pictures, SPECS, embed))
    plain = ConversationDataset(path, processor, max_seq_len=256)
    _assert_same(plain, want)
    built = CachedConversationDataset(path, processor, max_seq_len=256)
    reused = CachedConversationDataset(path, processor, max_seq_len=256)
    assert (built.cache_status, reused.cache_status) == ("built", "reused")
    _assert_same(reused, want)
    images = [image for c in plain.conversations for image in c.images]
    assert all(isinstance(image, RowImage) == embed for image in images) and images
    assert plain.conversations[2].source == f"{path}:row 2"
    # lazy: no image's bytes are kept, in the dataset's objects or in the cache
    png = (pictures / "red.png").read_bytes()[:16]
    assert png not in pickle.dumps(plain.conversations)
    cache_bytes = b"".join(p.read_bytes() for p in (pictures / CACHE_FOLDER).rglob("*.bin"))
    assert png not in cache_bytes
    # a changed file is a changed key (the same size: one answer's digit)
    rows = _table_rows(pictures, SPECS, embed)
    rows[1]["messages"][1]["content"][0]["text"] = "7"
    _parquet(path, rows)
    assert CachedConversationDataset(path, processor, max_seq_len=256).cache_status.startswith("rebuilt")


def test_folder_of_shards_and_sharegpt_rows(tmp_path, pictures, processor):
    want = ConversationDataset(_jsonl(pictures / "all.jsonl", SPECS), processor, max_seq_len=256)
    shards = pictures / "shards"
    _parquet(shards / "part-0.parquet", _table_rows(pictures, SPECS[:5], embed=True))
    sharegpt = [  # ShareGPT layout: `<image>` markers and an `image` (one struct) / `images` column
        {
            "conversations": [
                {"from": "human", "value": "<image>" * len(images) + q},
                {"from": "gpt", "value": a},
            ],
            "images": [_struct(pictures, i, True) for i in images],
        }
        for q, a, images in SPECS[5:]
    ]
    _parquet(shards / "part-1.parquet", sharegpt)
    (shards / "notes.txt").write_text("not a shard")
    got = CachedConversationDataset(shards, processor, max_seq_len=256)
    _assert_same(got, ConversationDataset(shards, processor, max_seq_len=256))
    for i in range(len(want)):  # the ShareGPT text differs ("<image>" then text): compare the pixels
        assert torch.equal(
            got[i].get("pixel_values", torch.zeros(0)), want[i].get("pixel_values", torch.zeros(0))
        )
    assert got.conversations[6].source == f"{shards / 'part-1.parquet'}:row 1"


def test_save_to_disk_folder_equals_jsonl(tmp_path, pictures, processor):
    want = ConversationDataset(_jsonl(pictures / "train.jsonl", SPECS), processor, max_seq_len=256)
    rows = _table_rows(pictures, SPECS, embed=True)
    features = datasets.Features(
        {
            "messages": datasets.List(
                {
                    "role": datasets.Value("string"),
                    "content": datasets.List(
                        {"type": datasets.Value("string"), "text": datasets.Value("string")}
                    ),
                }
            ),
            "images": datasets.List(datasets.Image()),
        }
    )
    folder = pictures / "saved"
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(folder), num_shards=3)
    assert len(list(folder.glob("*.arrow"))) > 1  # several Arrow files, read in state.json's order
    _assert_same(CachedConversationDataset(folder, processor, max_seq_len=256), want)
    _assert_same(ConversationDataset(folder, processor, max_seq_len=256), want)
    split = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2], features=features)})
    split.save_to_disk(str(pictures / "dict"))
    with pytest.raises(DataError, match="DatasetDict.*give one split's folder.*dict/train"):
        ConversationDataset(pictures / "dict", processor)


def test_bad_rows_are_counted_with_file_and_row(tmp_path, pictures, processor):
    rows = _table_rows(pictures, SPECS[:4], embed=True)
    rows[1]["images"] = [{"bytes": b"\x89PNG not an image", "path": "x.png"}]  # undecodable bytes
    rows[2]["images"] = [{"bytes": None, "path": "missing.png"}, {"bytes": None, "path": "red.png"}]
    rows[3]["messages"][0]["role"] = "robot"  # malformed messages
    path = _parquet(pictures / "bad.parquet", rows)
    for make in (ConversationDataset, CachedConversationDataset):
        data = make(path, processor, max_seq_len=256, on_bad_sample="skip")
        assert data.report.kept == 1 and dict(data.report.skipped) == {
            "unreadable_image": 1,
            "missing_image": 1,
            "bad_schema": 1,
        }
        assert [e.split(": ")[0] for e in data.report.examples] == [f"{path}:row {n}" for n in (1, 2, 3)]
    with pytest.raises(BadSample, match=rf"{path}:row 1: the bytes of image .*cannot be read"):
        ConversationDataset(path, processor, max_seq_len=256)


def test_messages_stored_as_json_text_are_decoded_and_bad_text_is_named(tmp_path, pictures, processor):
    """A string `messages` column (pandas / Spark exports) holding the list's JSON: the same samples."""
    want = ConversationDataset(_jsonl(pictures / "train.jsonl", SPECS), processor, max_seq_len=256)
    rows = [{**r, "messages": json.dumps(r["messages"])} for r in _table_rows(pictures, SPECS, True)]
    path = _parquet(pictures / "text.parquet", rows)
    assert pq.read_schema(path).field("messages").type == pa.string()
    _assert_same(ConversationDataset(path, processor, max_seq_len=256), want)
    _assert_same(CachedConversationDataset(path, processor, max_seq_len=256), want)
    rows[2]["messages"] = rows[2]["messages"][:-5]  # cut short: not JSON
    bad = _parquet(pictures / "cut.parquet", rows)
    with pytest.raises(
        BadSample, match=rf"{bad}:row 2: column 'messages' is a string that is not valid JSON"
    ):
        ConversationDataset(bad, processor, max_seq_len=256)
    skipped = CachedConversationDataset(bad, processor, max_seq_len=256, on_bad_sample="skip")
    assert skipped.report.kept == 8 and dict(skipped.report.skipped) == {"malformed_json": 1}
    assert skipped.report.examples[0].startswith(f"{bad}:row 2: column 'messages'")


def test_unknown_paths_say_what_is_accepted(tmp_path, processor):
    accepted = "a JSONL file .*a .parquet file, a folder of .parquet shards, or a folder written by datasets"
    with pytest.raises(DataError, match=f"not found; give {accepted}"):
        ConversationDataset(tmp_path / "nothing", processor)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        DataError, match=f"without .parquet files or a save_to_disk state.json; give {accepted}"
    ):
        ConversationDataset(tmp_path / "empty", processor)
    (tmp_path / "fake.parquet").write_text("{}")
    with pytest.raises(DataError, match="cannot be read as Parquet"):
        ConversationDataset(tmp_path / "fake.parquet", processor)


def _text_rows(tag, n):
    return [
        {"messages": [{"role": "user", "content": f"{tag} {i}?"}, {"role": "assistant", "content": str(i)}]}
        for i in range(n)
    ]


def _corrupt_row_group(path, group, out):
    """A copy of `path` whose row group `group` has every column chunk's bytes overwritten."""
    data = bytearray(path.read_bytes())
    metadata = pq.ParquetFile(path).metadata.row_group(group)
    for c in range(metadata.num_columns):
        chunk = metadata.column(c)
        begin = min(o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o is not None)
        data[begin : begin + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("batch_rows", [256, 3])
def test_a_range_read_decodes_only_its_own_row_groups(tmp_path, monkeypatch, batch_rows):
    from ntil_ds.data import tables
    from ntil_ds.data.sources import open_source

    monkeypatch.setattr(tables, "_BATCH_ROWS", batch_rows)  # batches smaller than a row group, too
    shards = tmp_path / "shards"
    for name, n in (("a", 18), ("b", 22)):  # row groups of 4 rows: a: 4,4,4,4,2; b: 4 x 5, 2
        _parquet(shards / f"{name}.parquet", _text_rows(name, n), row_group_size=4)
    whole = list(open_source(shards).rows())
    assert len(whole) == 40 and whole[18][:2] == (0, 1) and whole[39][:2] == (21, 1)
    for start, stop in ((0, 40), (5, 11), (16, 20), (18, 19), (37, None), (12, 12), (39, 45)):
        assert list(open_source(shards).rows(start, stop)) == whole[start:stop], (start, stop)
    broken = tmp_path / "broken"
    broken.mkdir()
    _corrupt_row_group(shards / "a.parquet", 0, broken / "a.parquet")  # every group before the range
    a = pq.ParquetFile(shards / "a.parquet")
    for group in range(1, a.metadata.num_row_groups):
        _corrupt_row_group(broken / "a.parquet", group, broken / "a.parquet")
    for group in range(0, 4):  # b's rows 0..15 (overall 18..33)
        source = broken / "b.parquet" if group else shards / "b.parquet"
        _corrupt_row_group(source, group, broken / "b.parquet")
    with pytest.raises(OSError):  # the corruption is real: a read through those groups fails
        list(open_source(broken).rows(0, 40))
    with pytest.raises(OSError):
        list(open_source(broken).rows(33, 40))  # overall row 33 is b's row 15, in group 3
    got = list(open_source(broken).rows(34, None))  # b's rows 16..21: groups 4 and 5 only
    assert [(r, f) for r, f, _ in got] == [(r, f) for r, f, _ in whole[34:]]
    assert [c.messages for *_, c in got] == [c.messages for *_, c in whole[34:]]


def test_a_range_of_a_save_to_disk_folder_is_the_full_reads_slice(tmp_path):
    from ntil_ds.data.sources import open_source

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(_text_rows("s", 23)).save_to_disk(str(folder), num_shards=3)
    assert len(open_source(folder).files) == 3
    whole = list(open_source(folder).rows())
    assert len(whole) == 23 and whole[8][:2] == (0, 1)  # 8 rows in the first file
    for start, stop in ((0, 23), (3, 9), (8, 16), (15, None), (22, 30), (5, 5)):
        assert list(open_source(folder).rows(start, stop)) == whole[start:stop], (start, stop)
