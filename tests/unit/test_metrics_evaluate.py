"""launch/evaluate.py on tiny random models saved with save_pretrained: the generation and scoring
pipeline end to end (accuracy is ~0 with random weights; the wiring is what is checked)."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from launch import evaluate
from ntil_ds.data import ConversationDataset, DataError, load_processor
from ntil_ds.data.synthetic import write_dataset
from ntil_ds.evaluation.generate import generate_and_score, load_exported_model, task_of
from ntil_ds.scoring import score
from ntil_ds.tiny import build_tiny_model_folder


def _exported_model(kind, folder):
    build_tiny_model_folder(kind, folder)
    torch.manual_seed(0)
    cls = AutoModelForCausalLM if kind == "qwen2" else AutoModelForImageTextToText
    cls.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("kind", "task"), [("qwen2_vl", "clock"), ("qwen2", "arithmetic")])
def test_evaluate_writes_a_report_scored_by_the_task_metrics(tmp_path, kind, task):
    model_dir = _exported_model(kind, tmp_path / "model")
    split = write_dataset(task, 40, tmp_path / task, seed=0)["test"]
    report = evaluate.main(
        ["--model", str(model_dir), "--split", str(split), "--batch-size", "3", "--max-new-tokens", "6"]
    )

    written = json.loads((model_dir / "eval_test.json").read_text())
    assert written["task"] == task and written["metrics"]["n"] == 4 == len(written["samples"])
    processor = load_processor(model_dir)
    dataset = ConversationDataset(split, processor, max_seq_len=512)
    assert [s["reference"] for s in written["samples"]] == [c.answers()[-1] for c in dataset.conversations]
    predictions = [s["prediction"] for s in written["samples"]]
    references = [s["reference"] for s in written["samples"]]
    recomputed = score(task, predictions, references)
    for name, value in recomputed.items():
        assert written["metrics"][name] == (None if isinstance(value, float) and math.isnan(value) else value)
    assert score(task, references, references)["exact_match"] == 1.0  # the reference path scores perfectly

    # batching with left padding changes nothing: one at a time gives the same answers
    model = load_exported_model(model_dir, "float32")
    one_by_one = generate_and_score(model, processor, dataset, task, batch_size=1, max_new_tokens=6)
    assert (
        [s["prediction"] for s in one_by_one["samples"]]
        == predictions
        == [s["prediction"] for s in report["samples"]]
    )


def test_task_must_be_known(tmp_path):
    split = tmp_path / "plain.jsonl"
    split.write_text(
        json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]})
        + "\n"
    )
    with pytest.raises(DataError, match="give --task"):
        task_of(split)
    with pytest.raises(SystemExit, match="give --task"):  # the CLI: the message, exit code 1
        evaluate.main(["--model", str(tmp_path), "--split", str(split)])


def _table_copy(split, embed):
    """The split's lines as table rows: image parts as the Hugging Face image struct (its bytes) or an
    absolute path, every content a list of parts (one Arrow type per column), the task column kept."""
    rows = []
    for line in split.read_text().splitlines():
        row = json.loads(line)
        for message in row["messages"]:
            if isinstance(message["content"], str):
                message["content"] = [{"type": "text", "text": message["content"]}]
            for part in message["content"]:
                if part["type"] == "image":
                    path = split.parent / part["image"]
                    part["image"] = (
                        {"bytes": path.read_bytes(), "path": part["image"]} if embed else str(path)
                    )
        rows.append(row)
    return rows


def test_evaluation_reads_every_input_the_trainer_reads(tmp_path):
    """launch/evaluate.py and the comparison's splits on a Parquet file (image bytes inside), a folder of
    shards and a save_to_disk folder holding the same items as a JSONL split: identical results."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ntil_ds.comparison.controls import write_shuffled_split
    from ntil_ds.comparison.splits import item_hashes, refuse_overlap, split_hash

    model_dir = _exported_model("qwen2_vl", tmp_path / "model")
    split = write_dataset("clock", 50, tmp_path / "clock", seed=0)["test"]
    parquet = tmp_path / "copies" / "test.parquet"
    parquet.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(_table_copy(split, embed=True)), parquet, row_group_size=2)
    shards = tmp_path / "copies" / "shards"
    shards.mkdir()
    rows = _table_copy(split, embed=True)
    for i, part in enumerate((rows[:2], rows[2:])):
        pq.write_table(pa.Table.from_pylist(part), shards / f"part-{i}.parquet")
    saved = tmp_path / "copies" / "saved"
    datasets.Dataset.from_list(_table_copy(split, embed=False)).save_to_disk(str(saved))

    def evaluated(path):  # the task from the first row: no --task
        args = ["--model", str(model_dir), "--split", str(path), "--max-new-tokens", "6"]
        return evaluate.main([*args, "--batch-size", "2", "--out", str(tmp_path / f"{path.name}.json")])

    want = evaluated(split)
    assert want["metrics"]["n"] == 5
    for copy in (parquet, shards, saved):
        got = evaluated(copy)
        assert (got["task"], got["metrics"]) == ("clock", want["metrics"]), copy
        for key in ("reference", "prediction"):
            assert [s[key] for s in got["samples"]] == [s[key] for s in want["samples"]], (copy, key)
        assert got["samples"][3]["source"].startswith(f"{copy}:row 3" if copy == parquet else str(copy))
        # the comparison's splits: the same items by content, so a copy of a training split is refused
        assert item_hashes(copy).keys() == item_hashes(split).keys(), copy
        with pytest.raises(SystemExit, match=f"5 of the 5 test items of {copy} are in the training split"):
            refuse_overlap(copy, [split])
    assert len({split_hash(p) for p in (split, parquet, shards, saved)}) == 4  # hashed: their own bytes
    shuffled = [write_shuffled_split(p, tmp_path / f"shuffled_{p.name}.jsonl", 5) for p in (split, parquet)]
    assert shuffled[0]["permutation"] == shuffled[1]["permutation"]
    assert item_hashes(Path(shuffled[0]["path"])).keys() == item_hashes(Path(shuffled[1]["path"])).keys()
