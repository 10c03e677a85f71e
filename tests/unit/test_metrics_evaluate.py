"""launch/evaluate.py on tiny random models saved with save_pretrained: the generation and scoring
pipeline end to end (accuracy is ~0 with random weights; the wiring is what is checked)."""

import json
import math

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
