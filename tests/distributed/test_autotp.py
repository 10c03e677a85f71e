"""DeepSpeed AutoTP with a vocab-parallel lm_head under ZeRO-3, through the real trainer.

Three jobs of launch/train.py run side by side on a tiny Qwen2 LLM whose vocabulary (515 rows) does
not split evenly:
- tp=2: 2 processes, configs/deepspeed/zero3_autotp.json (one tensor-parallel pair, dp=1), with a
  probe on the head's output (autotp_probe_job.py);
- tp=1: 1 process, configs/deepspeed/zero3.json, the same micro-batches (dp=1, 2 accumulation steps);
- tp=2 without ``vocab_parallel_lm_head``: must stop at start with an error that says what to set.
fp32 throughout: the tp=2 losses must equal the tp=1 losses (the loss then ran shard-locally on
[B, T, V/2] logits, reducing over the TP group, and drew the same Gumbel noise on both ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.tiny_llm import tiny_qwen2_folder, write_sum_data
from tests.distributed.training_runs import (
    REPO_ROOT,
    TRAIN_SCRIPT,
    finish_training,
    launch_env,
    start_training,
    train_metrics,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROBE_SCRIPT = Path(__file__).with_name("autotp_probe_job.py")
AUTOTP_JSON = REPO_ROOT / "configs" / "deepspeed" / "zero3_autotp.json"
STEPS = 5
MICRO_BATCH = 2
JOB_TIMEOUT_S = 360
EXTRA_VOCAB_ROWS = 3  # 512 tokens + 3 = 515 rows: shards of 258 and 257


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("autotp")
    model = tiny_qwen2_folder(root / "tiny-qwen2", extra_vocab_rows=EXTRA_VOCAB_ROWS)
    data = write_sum_data(root / "data" / "train.jsonl", n=64)

    from transformers import AutoTokenizer

    # Precondition: the labels use rows of both vocabulary shards, so both ranks hold targets.
    tokenizer = AutoTokenizer.from_pretrained(model)
    label_ids = set(tokenizer("It is 1234<|im_end|>")["input_ids"])
    half = (len(tokenizer) + EXTRA_VOCAB_ROWS + 1) // 2
    assert min(label_ids) < half <= max(label_ids), (label_ids, half)

    common: dict[str, object] = {
        "model.name_or_path": model,
        "model.kind": "llm",
        "model.dtype": "float32",
        "data.train_file": data,
        "data.eval_file": data,
        # generated answers at the last step, through the vocab-parallel head in the tp=2 run
        "eval.generate_every": STEPS,
        "eval.generate_samples": 4,
        "eval.max_new_tokens": 6,
        "eval.batch_size": 2,
        "eval.task": "arithmetic",
        "data.shuffle": "false",
        "train.max_steps": STEPS,
        "train.micro_batch_size": MICRO_BATCH,
        "train.global_batch_size": 2 * MICRO_BATCH,  # dp=1 in both runs: 2 accumulation steps
        "train.log_every": 1,
        "train.save_every": 0,
        "train.export_at_end": "false",
        "optim.warmup_steps": 0,
        "tracking.enabled": "false",
        "resume": "none",
    }
    no_vocab_parallel = root / "zero3_autotp_gathered_head.json"
    ds = json.loads(AUTOTP_JSON.read_text())
    ds["tensor_parallel"]["vocab_parallel_lm_head"] = False
    no_vocab_parallel.write_text(json.dumps(ds))

    probe_dir = root / "probe"
    probe_dir.mkdir()
    # All three at once: on 2 cores most of a job is start-up (imports, process groups), which overlaps.
    jobs = {
        "tp2": start_training(
            2,
            PROBE_SCRIPT,
            {**common, "deepspeed": AUTOTP_JSON, "output_dir": root / "tp2"},
            launch_env(LOGITS_PROBE_DIR=str(probe_dir)),
        ),
        "tp1": start_training(1, TRAIN_SCRIPT, {**common, "output_dir": root / "tp1"}, launch_env()),
        "gathered_head": start_training(
            2,
            TRAIN_SCRIPT,
            {**common, "deepspeed": no_vocab_parallel, "output_dir": root / "gathered_head"},
            launch_env(),
        ),
    }
    finished = {name: finish_training(job, JOB_TIMEOUT_S) for name, job in jobs.items()}
    return {"root": root, "probe_dir": probe_dir, "vocab_rows": len(tokenizer) + EXTRA_VOCAB_ROWS, **finished}


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_each_rank_holds_its_vocab_slice_of_the_logits(runs):
    rc, output = runs["tp2"]
    assert rc == 0, output[-4000:]
    vocab = runs["vocab_rows"]
    slices = []
    for rank in (0, 1):
        records = json.loads((runs["probe_dir"] / f"rank{rank}.json").read_text())
        training = [r for r in records if r["training"]]
        # One forward per micro-batch: STEPS x 2 accumulation steps, all through the sharded head; then
        # the forwards of generation (at least one per new token), sharded too.
        assert len(training) == STEPS * 2, records
        assert len(records) - len(training) >= 6
        for record in records:
            width = record["vocab_end"] - record["vocab_start"]
            assert record["vocab_size"] == vocab and record["weight_rows"] == width
            if record["training"]:
                # loss.logits=labelled: the head's output is the row statistics of its slice at the
                # labelled rows (ce, 10 digit columns, row max, 20 noise values), never logits
                assert len(record["shape"]) == 3 and record["shape"][0] == 1 and record["shape"][2] == 32
            else:
                assert record["shape"][-1] == width
        slices.append((records[0]["vocab_start"], records[0]["vocab_end"]))
    # Uneven split, contiguous, covering the whole vocabulary: [0, 258) and [258, 515).
    assert slices == [(0, (vocab + 1) // 2), ((vocab + 1) // 2, vocab)], slices


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_tp2_losses_equal_tp1(runs):
    for name in ("tp1", "tp2"):
        rc, output = runs[name]
        assert rc == 0, f"{name}:\n{output[-4000:]}"
    tp1 = train_metrics(runs["root"] / "tp1")
    tp2 = train_metrics(runs["root"] / "tp2")
    assert sorted(tp1) == sorted(tp2) == list(range(1, STEPS + 1))
    # First step: same weights, same batch: only summation order differs.
    assert tp2[1]["loss"] == pytest.approx(tp1[1]["loss"], rel=1e-6, abs=0)
    for step in range(1, STEPS + 1):
        for key in ("loss", "ce", "ntil", "emd", "rel", "mag", "labelled_tokens"):
            assert tp2[step][key] == pytest.approx(tp1[step][key], rel=1e-5, abs=1e-7), (step, key)
    assert tp1[STEPS]["loss"] < tp1[1]["loss"]  # it trained (not a frozen model agreeing with itself)
    # Generated answers: the vocab slices gathered before each greedy choice give tp=1's answers.
    answers = {
        name: (runs["root"] / name / "generated" / f"step_{STEPS:08d}.jsonl").read_text().splitlines()
        for name in ("tp1", "tp2")
    }
    assert len(answers["tp1"]) == 4 and answers["tp2"] == answers["tp1"]
    assert train_metrics(runs["root"] / "tp2", split="generate")[STEPS]["n"] == 4


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_autotp_without_vocab_parallel_head_is_refused(runs):
    rc, output = runs["gathered_head"]
    assert rc != 0
    assert "vocab_parallel_lm_head" in output and "is not vocab-parallel" in output, output[-4000:]
    assert not (runs["root"] / "gathered_head" / "metrics.jsonl").exists()  # stopped before any step
