"""DeepSpeed Ulysses sequence parallelism through the real trainer: 2 ranks splitting every row
(parallel.sequence_parallel_size=2, the labelled head) equal one process with whole rows and the logits
everywhere, on a tiny Qwen2 LLM in float32: full fine-tuning on ZeRO-3, and LoRA on ZeRO-2, whose
sequence-parallel job is then resumed from its step-1 checkpoint to the same step 2 and export.

The rows (77 tokens, padded to 78: the slices are positions 0-38 and 39-77) are built so that the
boundary falls inside the answer's first number, which NTIL then reads from digits on both ranks. Both
jobs train with NTIL in paper mode, Gumbel noise on (its draws must not depend on the sequence-parallel
size), and evaluate at the end (teacher-forced and generated answers: in evaluation every rank of the
group runs whole rows). Compared: every step's labelled tokens, loss, CE, NTIL parts and grad norm, the
evaluation metrics, and every exported weight (the adapter's, for LoRA). The recipe's layout, 2
data-parallel groups of 2 sequence-parallel ranks (4 processes), on rows of different lengths (right
padding, which Ulysses' attention sees without its mask), equals 2 data-parallel ranks with whole rows.
A tiny Qwen2-VL on rows of two clock images, one on each side of the cut, with a number across it, at
SP=2 equals one process (the vision tower split over the ranks, the merged row sliced after the merge).
optim.eps=1 makes Adam's step proportional to the gradient (not its sign), so the weights check the
gradient's scale too.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.tiny_llm import tiny_qwen2_folder
from tests.distributed.training_runs import (
    TRAIN_SCRIPT,
    finish_training,
    launch_env,
    start_training,
    train_metrics,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 2
JOB_TIMEOUT_S = 400


def write_two_clock_data(out_dir, n: int, seed: int = 0) -> Path:
    """Two turns a row, each with a clock image (4 image tokens on the tiny Qwen2-VL): "HH:MM" and two
    numbers (8 and 7 digits) after the first, "HH:MM" after the second. Every row is 114 tokens: the cut
    at 57 falls inside the first answer's 8-digit number, with one image on each side of it."""
    from ntil_ds.data.synthetic import make_clock_easy

    rng = random.Random(seed)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        turns = []
        for turn, clock in enumerate((make_clock_easy(rng), make_clock_easy(rng))):
            path = f"images/{i}_{turn}.png"
            clock.image.save(out_dir / path)
            numbers = f" {rng.randint(10**7, 10**8 - 1)} {rng.randint(10**6, 10**7 - 1)}" if turn == 0 else ""
            content = [{"type": "image", "image": path}, {"type": "text", "text": clock.question}]
            turns += [
                {"role": "user", "content": content},
                {"role": "assistant", "content": clock.answer + numbers},
            ]
        lines.append(json.dumps({"messages": turns}))
    (out_dir / "train.jsonl").write_text("\n".join(lines) + "\n")
    return out_dir / "train.jsonl"


def write_long_number_data(path, n: int, seed: int = 0, ragged: bool = False) -> None:
    """Rows of one length: "Read <k>" -> "It is" and five numbers (8, then 7 digits each); ``ragged``:
    two to five numbers a row, so a micro-batch's rows are right-padded to its longest."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        count = 2 + (i * 3) % 4 if ragged else 5
        numbers = [rng.randint(10**7, 10**8 - 1)] + [rng.randint(10**6, 10**7 - 1) for _ in range(count - 1)]
        answer = "It is " + " ".join(str(x) for x in numbers)
        messages = [{"role": "user", "content": f"Read {i % 10}"}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from ntil_ds.data import ConversationDataset, load_processor
    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("sequence_parallel")
    model_dir = tiny_qwen2_folder(root / "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.save_pretrained(model_dir)
    data = root / "train.jsonl"
    write_long_number_data(data, n=8)
    ragged = root / "ragged.jsonl"
    write_long_number_data(ragged, n=8, seed=1, ragged=True)

    # Precondition: every row's slice boundary is inside a number (targets on both sides are digits).
    processor = load_processor(model_dir)
    digits = {processor.convert_tokens_to_ids(str(d)) for d in range(10)}
    dataset = ConversationDataset(data, processor, max_seq_len=256)
    for i in range(len(dataset)):
        targets = dataset[i]["targets"].tolist()
        assert len(targets) == 77, len(targets)
        assert targets[38] in digits and targets[39] in digits, (i, targets[30:50])

    common = {
        "model.name_or_path": model_dir,
        "model.kind": "llm",
        "model.init": "pretrained",
        "model.dtype": "float32",
        "data.train_file": data,
        "data.eval_file": data,
        "data.shuffle": "false",
        "loss.name": "ntil",
        "optim.name": "adamw_torch",
        "optim.lr": 0.05,
        "optim.eps": 1.0,
        "optim.grad_clip": 0.0,
        "optim.warmup_steps": 0,
        "train.max_steps": STEPS,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,  # dp=1 in both jobs: 2 micro-batches a step
        "train.log_every": 1,
        "train.save_every": 0,
        "train.export_at_end": "true",
        "train.eval_every": STEPS,
        "eval.generate_every": STEPS,
        "eval.generate_samples": 4,
        "eval.max_new_tokens": 4,
        "eval.batch_size": 2,
        "eval.task": "arithmetic",
        "tracking.enabled": "false",
        "resume": "none",
    }
    # The multimodal model: a tiny Qwen2-VL, whole rows in, each rank's language model on its slice.
    vl_dir = build_tiny_model_folder("qwen2_vl", root / "vl_model")
    torch.manual_seed(0)
    vl_model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(vl_dir), dtype=torch.float32
    )
    vl_model.save_pretrained(vl_dir)
    vl_data = write_two_clock_data(root / "vl_data", n=8)
    vl_processor = load_processor(vl_dir)
    vl_digits = {vl_processor.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    vl_dataset = ConversationDataset(vl_data, vl_processor, max_seq_len=256)
    for i in range(len(vl_dataset)):  # precondition: a number across the cut, an image on each side
        targets, ids = vl_dataset[i]["targets"].tolist(), vl_dataset[i]["input_ids"]
        assert len(targets) == 114 and targets[56] in vl_digits and targets[57] in vl_digits, (
            i,
            targets[50:64],
        )
        image = (ids == vl_model.config.image_token_id).nonzero().squeeze(1)
        assert image.min() < 57 <= image.max(), (i, image.tolist())
    vl = {
        "model.name_or_path": vl_dir,
        "model.kind": "mllm",
        "data.train_file": vl_data,
        "data.eval_file": vl_data,
    }

    sp2 = {"parallel.sequence_parallel_size": 2}
    one = {"loss.logits": "all"}
    variants = {  # name: processes, overrides
        "one": (1, one),
        "sp2": (2, sp2),
        "one_lora": (1, {**one, **LORA}),
        "sp2_lora": (2, {**sp2, **LORA, "train.save_every": 1}),
        # The layout the long-sequence recipe uses (data parallel x sequence parallel), on rows of different
        # lengths (Ulysses drops the attention mask: right padding must not reach a real token): 4 ranks
        # as 2 x 2 against 2 data-parallel ranks with whole rows.
        "dp2_ragged": (2, {**one, "data.train_file": ragged, "data.eval_file": ragged}),
        "dp2sp2_ragged": (4, {**sp2, "data.train_file": ragged, "data.eval_file": ragged}),
        "vl_one": (1, {**one, **vl}),
        "vl_sp2": (2, {**sp2, **vl}),
    }

    def start(name: str):
        nproc, extra = variants[name]
        return start_training(
            nproc, TRAIN_SCRIPT, {**common, **extra, "output_dir": root / name}, launch_env()
        )

    # All four at once: on 2 cores most of a job is start-up (imports, process groups), which overlaps.
    jobs = {name: start(name) for name in variants}
    finished = {name: finish_training(job, JOB_TIMEOUT_S) for name, job in jobs.items()}
    for name, (rc, output) in finished.items():
        assert rc == 0, f"{name}:\n{output[-6000:]}"
    results = {name: _results(root / name, finished[name][1]) for name in variants}

    # Resume: the step-2 checkpoint and the export gone, the job continues from step 1 (resume=auto).
    resumed_dir = root / "sp2_lora"
    shutil.rmtree(resumed_dir / "checkpoints" / f"step_{STEPS:08d}")
    shutil.rmtree(resumed_dir / "export")
    rc, output = finish_training(
        start_training(
            2,
            TRAIN_SCRIPT,
            {**common, **variants["sp2_lora"][1], "output_dir": resumed_dir, "resume": "auto"},
            launch_env(),
        ),
        JOB_TIMEOUT_S,
    )
    assert rc == 0, output[-6000:]
    assert "resumed from" in output and "step_00000001" in output, output[-3000:]
    results["sp2_lora_resumed"] = _results(resumed_dir, output)
    initial = {
        "initial": load_file(model_dir / "model.safetensors"),
        "vl_initial": load_file(vl_dir / "model.safetensors"),
    }
    return results | initial | {"ragged": ragged}


LORA = {
    "lora.enabled": "true",
    "lora.r": 4,
    "lora.alpha": 8,
    "lora.dropout": 0.0,  # exact comparisons
    "deepspeed": "configs/deepspeed/zero2.json",
}


def _results(out, log: str) -> dict:
    export = out / "export"
    weights = export / (
        "adapter_model.safetensors" if (export / "adapter_config.json").exists() else "model.safetensors"
    )
    return {
        "train": train_metrics(out),
        "eval": train_metrics(out, split="eval"),
        "generate": train_metrics(out, split="generate"),
        "weights": load_file(weights),
        "log": log,
    }


def assert_same_run(sp2: dict, one: dict, steps=range(1, STEPS + 1)) -> None:
    """Every step's counts, loss, parts and grad norm, the evaluations and every exported weight."""
    for step in steps:
        got, want = sp2["train"][step], one["train"][step]
        assert got["labelled_tokens"] == want["labelled_tokens"], step
        for key in ("loss", "ce", "ntil", "emd", "rel", "mag"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (step, key, got[key], want[key])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6), step
        assert want["rel"] > 0 and want["grad_norm"] > 0
    for split in ("eval", "generate"):  # teacher-forced, and generated answers
        got, want = sp2[split][STEPS], one[split][STEPS]
        assert set(got) == set(want), split
        for key, value in want.items():
            if isinstance(value, float) and not key.endswith("_s"):  # not the timings
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (split, key)
    assert sp2["weights"].keys() == one["weights"].keys()
    for name, expected in one["weights"].items():
        torch.testing.assert_close(sp2["weights"][name], expected, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_two_sequence_parallel_ranks_train_as_one_process_with_whole_rows(runs):
    sp2, initial = runs["sp2"], runs["initial"]
    assert "Ulysses sequence parallelism: 2 ranks a group" in sp2["log"], sp2["log"][-3000:]
    assert_same_run(sp2, runs["one"])
    assert sp2["weights"].keys() == initial.keys()
    moved = sum(not torch.equal(w, initial[name]) for name, w in sp2["weights"].items())
    assert moved > len(initial) // 2  # the steps did update the weights compared


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_lora_on_zero2_with_sequence_parallelism_equals_one_process_and_resumes_to_the_same_export(runs):
    sp2, resumed = runs["sp2_lora"], runs["sp2_lora_resumed"]
    assert any("lora_B" in name for name in sp2["weights"]), list(sp2["weights"])[:5]
    assert_same_run(sp2, runs["one_lora"])
    assert_same_run(resumed, sp2, steps=[STEPS])  # the resumed job trained step 2 again
    assert any(sp2["weights"][n].abs().max() > 0 for n in sp2["weights"] if "lora_B" in n)  # B moved from 0


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_two_data_parallel_groups_of_two_sequence_ranks_on_ragged_rows_equal_two_ranks_with_whole_rows(runs):
    layout = runs["dp2sp2_ragged"]
    assert "Ulysses sequence parallelism: 2 ranks a group" in layout["log"], layout["log"][-3000:]
    # each step's 4 rows (unshuffled: rows 0-3, then 4-7) have 4 lengths (2-5 numbers an answer), so every
    # micro-batch, however the ranks share them, is right-padded
    answers = [json.loads(line)["messages"][1]["content"] for line in runs["ragged"].read_text().splitlines()]
    assert all(len({len(a) for a in answers[i : i + 4]}) == 4 for i in range(0, len(answers), 4)), answers
    assert_same_run(layout, runs["dp2_ragged"])


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_vision_language_model_at_two_sequence_parallel_ranks_trains_as_one_process(runs):
    """Tiny Qwen2-VL on rows of two clock images, one on each side of the cut, and a number across it:
    each rank runs the vision tower on its share of the micro-batch's 4 images, and its language model
    takes its slice of the embeddings merged on whole rows, with the 3-D rotary positions computed on the
    whole row (a slice would number the second image from its own start)."""
    sp2, initial = runs["vl_sp2"], runs["vl_initial"]
    assert "Ulysses sequence parallelism: 2 ranks a group" in sp2["log"], sp2["log"][-3000:]
    assert_same_run(sp2, runs["vl_one"])
    vision = [name for name in initial if ".visual." in f".{name}"]
    assert vision and all(not torch.equal(sp2["weights"][n], initial[n]) for n in vision)  # the tower trained
