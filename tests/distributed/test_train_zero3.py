"""The real job, 2 CPU processes on ZeRO-3: NTIL trains tiny Qwen2-VL, LLaVA, Qwen3-VL, Gemma 3,
InternVL and SmolVLM on mixed text/image batches, a killed job resumes exactly, and the export loads
without DeepSpeed.

One uninterrupted Qwen2-VL run (deepspeed launcher) serves several tests: loss falls, the resume
reference, the export check.
"""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch

from ntil_ds.config import load_config
from tests.distributed.training_runs import (
    allreduce_workspaces_left,
    kill_after_checkpoint,
    run_together,
    run_training,
    tiny_model_and_data,
    train_metrics,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
STEP_KEYS = ("loss", "ce", "ntil", "emd", "rel", "mag", "lr", "grad_norm", "tokens_per_s", "peak_mem_mib")


def base_overrides(model_dir: Path, data_file: Path, output_dir: Path) -> dict[str, object]:
    return {
        "output_dir": output_dir,
        "model.name_or_path": model_dir,
        "model.init": "random",
        "model.dtype": "float32",  # exact comparisons (resume, export)
        "data.train_file": data_file,
        "data.eval_file": "",
        "data.max_seq_len": 128,
        "data.shuffle": "false",  # the data file's block pattern decides who gets images
        "loss.name": "ntil",
        "optim.name": "adamw_torch",
        "optim.lr": 3e-3,
        "optim.warmup_steps": 0,
        "optim.min_lr_ratio": 0.1,
        "train.max_steps": STEPS,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,  # 2 ranks x 2 x 2 accumulation steps
        "train.save_every": 3,
        "train.eval_every": 0,
        "train.log_every": 1,
        "train.export_at_end": "false",
        "tracking.enabled": "false",
    }


# Numeric metrics of generated answers while training (ntil_ds/evaluation/numeric.py)
GENERATE = {
    "eval.generate_every": 3,
    "eval.generate_samples": 6,
    "eval.max_new_tokens": 4,
    "eval.batch_size": 2,
    "eval.task": "arithmetic",
}


@pytest.fixture(scope="module")
def qwen_setup(tmp_path_factory):
    return tiny_model_and_data(tmp_path_factory.mktemp("qwen2vl"), "qwen2_vl", n=48, image_size=56)


@pytest.fixture(scope="module")
def uninterrupted_run(qwen_setup):
    """6 steps, checkpoint at 3 and 6, eval at 3 and 6 (teacher-forced, and generated answers to the first
    6 eval lines: 2 with an image, 4 without), tracked in MLflow, exported at the end."""
    root, model_dir, data_file = qwen_setup
    out = root / "uninterrupted"
    overrides = {
        **base_overrides(model_dir, data_file, out),
        "data.eval_file": data_file,
        "train.eval_every": 3,
        **GENERATE,
        "train.export_at_end": "true",
        "tracking.enabled": "true",
        "tracking.uri": f"sqlite:///{root / 'mlflow.db'}",
    }
    result = run_training(overrides, launcher="deepspeed")
    assert result.returncode == 0, result.stdout[-6000:]
    return out, result.stdout


@pytest.mark.timeout(1200)
def test_ntil_loss_falls_on_mixed_text_and_image_batches(qwen_setup, uninterrupted_run):
    out, log = uninterrupted_run
    metrics = train_metrics(out)
    # NTIL's gradient reaches the weights: the same first step under plain CE (same weights, data and
    # CE value) has another gradient. (The logged loss is (1 + lambda) x CE by construction and falls
    # with CE alone, so the loss curve below cannot show this.)
    root, model_dir, data_file = qwen_setup
    ce_out = root / "ce_one_step"
    ce = run_training(
        {**base_overrides(model_dir, data_file, ce_out), "loss.name": "ce", "train.max_steps": 1}
    )
    assert ce.returncode == 0, ce.stdout[-4000:]
    ce_step = train_metrics(ce_out)[1]
    assert ce_step["ce"] == pytest.approx(metrics[1]["ce"], rel=1e-6)
    assert ce_step["grad_norm"] != pytest.approx(metrics[1]["grad_norm"], rel=1e-3), (ce_step, metrics[1])
    # ... and not merely a scaled CE gradient: a loss of (1 + lambda) x CE without NTIL's own gradient
    # would give (1 + lambda) x CE's norm
    scaled = (1 + load_config(out / "config.yaml").loss.ntil_lambda) * ce_step["grad_norm"]
    assert scaled != pytest.approx(metrics[1]["grad_norm"], rel=1e-3), (ce_step, metrics[1])
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for record in metrics.values():
        for key in STEP_KEYS:
            assert math.isfinite(record[key]), (key, record)
        # The logged loss is NTIL's value: (1 + ntil_lambda) x CE per token.
        assert record["loss"] == pytest.approx(1.3 * record["ce"], rel=1e-5)
    losses = [metrics[s]["loss"] for s in range(1, STEPS + 1)]
    assert losses[-1] < 0.9 * losses[0], losses
    # The schedule: cosine from optim.lr (no warmup) towards lr x min_lr_ratio.
    assert metrics[1]["lr"] == pytest.approx(3e-3)
    assert all(metrics[s]["lr"] > metrics[s + 1]["lr"] for s in range(1, STEPS))
    evals = train_metrics(out, split="eval")
    assert sorted(evals) == [3, 6]
    assert evals[6]["loss"] < evals[3]["loss"]
    assert all(0.0 <= e["token_acc"] <= 1.0 and 0.0 <= e["digit_acc"] <= 1.0 for e in evals.values())
    # The run is reproducible from what it wrote: resolved recipe + merged DeepSpeed config.
    assert (out / "config.yaml").is_file()
    ds = (out / "deepspeed.json").read_text()
    assert '"train_batch_size": 8' in ds and '"gradient_accumulation_steps": 2' in ds
    assert "step 6/6 loss" in log  # rank 0's step log


@pytest.mark.timeout(600)
def test_generated_answers_under_zero3_are_the_trained_models(qwen_setup, uninterrupted_run):
    """The answers generated by 2 ZeRO-3 ranks at step 6 (every rank running every forward, image
    prompts batched apart from text-only ones) are the exported step-6 model's, generated on one process
    with plain transformers in the same batches; their scores are logged at steps 3 and 6 and plotted."""
    from mlflow import MlflowClient
    from transformers import AutoModelForImageTextToText

    from ntil_ds.data import ConversationDataset, load_processor, prompt_batch, tokenizer_of
    from ntil_ds.evaluation.numeric import plan_batches
    from ntil_ds.scoring import score

    root, _, data_file = qwen_setup
    out = uninterrupted_run[0]
    generated = train_metrics(out, split="generate")
    assert sorted(generated) == [3, 6] and generated[6]["n"] == 6
    answers = [
        json.loads(line) for line in (out / "generated" / "step_00000006.jsonl").read_text().splitlines()
    ]
    processor = load_processor(out / "export")
    subset = ConversationDataset(data_file, processor, max_seq_len=128).conversations[:6]
    assert [a["reference"] for a in answers] == [c.answers()[-1] for c in subset]
    assert sum(bool(c.images) for c in subset) == 2  # both kinds of batch ran
    model = AutoModelForImageTextToText.from_pretrained(out / "export", dtype=torch.float32).eval()
    tokenizer = tokenizer_of(processor)
    expected = {}
    for rank in (0, 1):
        for batch in plan_batches([bool(c.images) for c in subset], rank, 2, GENERATE["eval.batch_size"]):
            inputs = prompt_batch(processor, [subset[i] for i, _ in batch])
            with torch.no_grad():
                output = model.generate(
                    **inputs,
                    max_new_tokens=4,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            texts = tokenizer.batch_decode(
                output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            )
            expected.update(
                {i: text.strip() for (i, counted), text in zip(batch, texts, strict=True) if counted}
            )
    assert [a["prediction"] for a in answers] == [expected[i] for i in range(6)]
    want = score("arithmetic", [a["prediction"] for a in answers], [a["reference"] for a in answers])
    assert (
        generated[6]["parse_rate"] == want["parse_rate"]
        and generated[6]["exact_match"] == want["exact_match"]
    )

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("ntil-ds-demo").experiment_id])[0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/parse_rate")] == [3, 6]
    plots = [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
    assert "plots/eval_scores.png" in plots


def test_deepspeed_cpu_allreduce_workspaces_are_not_left_in_shared_memory(uninterrupted_run):
    """DeepSpeed's CPU allreduce never unlinks the 64 MiB per rank it puts in /dev/shm; the job unlinks
    them once every rank has mapped them (engine.init_distributed), so none outlives the job."""
    _, log = uninterrupted_run
    port = re.search(r"--master_port[= ](\d+)", log).group(1)
    unlinked = [line for line in log.splitlines() if "allreduce workspaces unlinked" in line]
    # made, named as computed from the launcher's address and port, and unlinked (rank 0 says so)
    assert len(unlinked) == 1 and unlinked[0].endswith(f"_127.0.0.1_{port}_0"), unlinked
    assert not allreduce_workspaces_left(port)


@pytest.mark.timeout(1500)
def test_killed_job_resumes_and_reproduces_the_uninterrupted_losses(qwen_setup, uninterrupted_run):
    root, model_dir, data_file = qwen_setup
    reference = train_metrics(uninterrupted_run[0])
    out = root / "killed"
    overrides = {
        **base_overrides(model_dir, data_file, out),
        "tracking.enabled": "true",
        "tracking.uri": f"sqlite:///{root / 'mlflow_resume.db'}",
    }
    job_log = root / "killed_job.log"
    kill_after_checkpoint(overrides, 3, log_path=job_log)
    assert not (out / "checkpoints" / "step_00000006").exists(), "the job finished before it was killed"
    # A checkpoint the dying job was writing: must never be picked.
    half_written = out / "checkpoints" / "step_00000005"
    half_written.mkdir(exist_ok=True)
    (half_written / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"truncated")
    first_run_id = (out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text()

    resumed = run_training(overrides)  # resume=auto (the recipe's default)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "resumed from" in resumed.stdout and "step_00000003" in resumed.stdout
    metrics = train_metrics(out)
    for step in range(1, STEPS + 1):
        for key in ("loss", "ce", "ntil", "grad_norm"):
            assert metrics[step][key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-7), (step, key)
    # The resumed job continued the same MLflow run.
    run_id = json.loads(first_run_id)["tracker_run_id"]
    assert run_id, [line for line in job_log.read_text().splitlines() if "mlflow" in line.lower()][-20:]
    final = json.loads((out / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert final["tracker_run_id"] == run_id and final["step"] == STEPS


@pytest.mark.timeout(1200)
def test_export_loads_without_deepspeed_and_matches_the_trained_weights(qwen_setup, uninterrupted_run):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ntil_ds.data import Collator, ConversationDataset, load_processor

    _, model_dir, data_file = qwen_setup
    out = uninterrupted_run[0]
    exported = AutoModelForImageTextToText.from_pretrained(out / "export", dtype=torch.float32).eval()
    # The reference: the fp32 master weights DeepSpeed kept in its ZeRO-3 partitions at the last step.
    trained = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(model_dir), dtype=torch.float32
    )
    masters = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step_00000006")
    missing, unexpected = trained.load_state_dict(masters, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    trained.eval()

    processor = load_processor(out / "export")  # the exported processor works
    dataset = ConversationDataset(data_file, processor, max_seq_len=128)
    batch = Collator(processor)([dataset[i] for i in (0, 1, 4, 8)])  # images and text
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    with torch.no_grad():
        assert torch.equal(exported(**inputs).logits, trained(**inputs).logits)
    for name, value in masters.items():
        assert torch.equal(exported.state_dict()[name], value), name


# Image sizes that give each family a few image tokens (LLaVA and Gemma 3 resize to 28x28 anyway;
# InternVL: one 28x28 tile; SmolVLM scales every image to 84x84: 3x3 tiles + the whole image, 40 tokens).
OTHER_FAMILIES = {
    "llava": 28,
    "qwen3_vl": 56,
    "gemma3": 28,
    "internvl": 28,
    "smolvlm": 28,
    "qwen3_vl_moe": 56,
    "mllama": 28,  # one 28x28 tile, read by the cross-attention layer; digits grouped: grouped NTIL
    "glm4v": 56,  # digits grouped: grouped NTIL
    # PixtralProcessor with its PIL image processor (no torchvision); tokenizer.json's grouping regex fixed
    # to single digits on loading: NTIL's single-digit loss
    "mistral3": 28,
}


@pytest.fixture(scope="module")
def family_runs(request, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """One job per family whose test was selected, run together (``run_together``): its output folder
    and the finished job."""
    selected = {
        item.callspec.params["kind"]
        for item in request.session.items
        if item.originalname == "test_other_families_ntil_loss_falls_and_export_reloads"
    }

    outs, jobs = {}, {}
    for kind in sorted(selected):  # the inputs one after the other, the jobs together
        root, model_dir, data_file = tiny_model_and_data(
            tmp_path_factory.mktemp(kind), kind, n=48, image_size=OTHER_FAMILIES[kind]
        )
        outs[kind] = root / "run"
        overrides = {
            **base_overrides(model_dir, data_file, outs[kind]),
            "train.save_every": 0,
            "train.export_at_end": "true",
        }
        jobs[kind] = partial(run_training, overrides)
    finished = run_together(jobs)
    return {kind: (outs[kind], finished[kind]) for kind in jobs}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", sorted(OTHER_FAMILIES))
def test_other_families_ntil_loss_falls_and_export_reloads(family_runs, kind):
    """The same job on LLaVA, Qwen3-VL, Gemma 3, InternVL, SmolVLM, Mllama, GLM-4V (its tokenizer groups
    digits, so the grouped NTIL loss trains it), Mistral 3 and Qwen3-VL-MoE (with its aux loss at the
    family's coefficient): mixed text/image batches, 2 ranks, ZeRO-3; the loss falls; the export loads
    with plain from_pretrained (no missing or unexpected weights) and holds the trained masters.
    Qwen3.5, Qwen3.5-MoE and GLM-4.5V train on 2 ZeRO-3 ranks in test_train_normalization.py, equal to
    one process step by step, and their export is checked there the same way (one job serves both)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForImageTextToText

    out, result = family_runs[kind]
    assert result.returncode == 0, result.stdout[-6000:]
    metrics = train_metrics(out)
    losses = [metrics[s]["loss"] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(metrics[s]["ntil"] > 0 for s in metrics)  # NTIL is on, and sees the digits

    exported, info = AutoModelForImageTextToText.from_pretrained(
        out / "export", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    masters = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=f"step_{STEPS:08d}")
    state = exported.state_dict()
    for name, value in masters.items():
        assert torch.equal(state[name], value), name


@pytest.mark.timeout(1200)
def test_llama4_text_model_trains_with_grouped_ntil_and_export_reloads(tmp_path):
    """Llama 4 (Scout's layout: every layer MoE, top-1 sigmoid router, a shared expert; digits grouped
    1-3): its text model (``model.kind=llm``: transformers 5.24's Llama4ForConditionalGeneration.forward
    fails on every input) on text-only arithmetic (its image processor needs torchvision, missing here),
    2 ranks, ZeRO-3 with its experts as leaf modules: the grouped NTIL loss falls, the expert load is
    logged (no aux loss: Llama 4 defines none), and the export reloads as a plain Llama4ForCausalLM
    holding the trained masters."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from ntil_ds.tiny import build_tiny_model_folder

    model_dir = build_tiny_model_folder("llama4", tmp_path / "model")
    data_file = write_text_arithmetic_data(tmp_path / "data", n=48)
    out = tmp_path / "run"
    overrides = {
        **base_overrides(model_dir, data_file, out),
        "model.kind": "llm",
        "train.save_every": 0,
        "train.export_at_end": "true",
    }
    result = run_training(overrides)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "ZeRO-3 leaf modules: Llama4TextExperts" in result.stdout, result.stdout[-3000:]
    metrics = train_metrics(out)
    losses = [metrics[s]["loss"] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(metrics[s]["ntil"] > 0 for s in metrics)  # the grouped loss sees the digits
    assert all(0 < metrics[s]["expert_share_max"] <= 1 for s in metrics), metrics[1]
    assert "aux_loss" not in metrics[1]

    exported, info = AutoModelForCausalLM.from_pretrained(
        out / "export", dtype=torch.float32, output_loading_info=True
    )
    assert type(exported).__name__ == "Llama4ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    masters = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=f"step_{STEPS:08d}")
    state = exported.state_dict()
    for name, value in masters.items():
        assert torch.equal(state[name], value), name


def write_text_arithmetic_data(out_dir: Path, n: int, seed: int = 0) -> Path:
    """Text-only arithmetic Q/A (three-digit sums, so the grouped tokenizer makes multi-digit tokens)."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        messages = [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": str(a + b)},
        ]
        lines.append(json.dumps({"messages": messages}))
    path = out_dir / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
