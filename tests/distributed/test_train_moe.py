"""Mixture of experts under ZeRO-3: 2 ranks whose tokens go to disjoint experts train exactly as one
process on the whole batch (every step's loss and grad norm, the exported weights).

The tiny Qwen3-VL-MoE (4 experts, top-2, 2 sparse layers) is given weights that route by the data: one
residual dimension ``D`` carries a sign, +1 on the tokens only rank 0's samples have, -1 on those only
rank 1's have, 0 on the shared ones (template, digits). Layer 0's attention writes its causal mean
into ``D`` (positive weights: the sign of the sample's first token, which is the rank's own, survives);
nothing else ever writes ``D`` (the other attention and every expert's output row ``D`` are zero), and
every router sends ``+D`` to experts {0, 1} and ``-D`` to {2, 3}. A probe on the routers
(moe_routing_job.py) records where every forward's tokens went: the test asserts the split happened.

Ranks that route to different experts are where ZeRO-3 MoE training hangs (each rank gathering only
the experts it uses); the job's timeout turns a hang into a failure. With transformers 5's fused
experts (one module, 3-D weights) every rank enters every expert module, and the engine marks those
modules as ZeRO-3 leaves (engine.set_expert_leaf_modules).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from ntil_ds.jobs import REPO_ROOT
from tests.distributed.training_runs import (
    kill_after_checkpoint,
    launch_env,
    run_together,
    run_training,
    train_metrics,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROBE_JOB = REPO_ROOT / "tests" / "distributed" / "moe_routing_job.py"
STEPS = 3
D = 7  # the residual dimension that carries the routing sign
SIGN = 4.0  # its size: far above the other entries (init std 0.02), so the steps' updates keep the split
RANK_PROMPTS = ("Add {a} and {b}.", "Sum of {a} with {b}?")  # rank 0's samples (even), rank 1's (odd)
# Qwen's template starts every sample with <|im_start|>: one token that both ranks share at position 0,
# which (attending only to itself) would route alike on both. This one starts with the user's text.
BARE_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] if message['content'] is string else "
    "message['content'] | selectattr('text', 'defined') | map(attribute='text') | join('') }}"
    "{% if message['role'] == 'user' %} =\n{% else %}<|im_end|>\n{% endif %}{% endfor %}"
)
JOB_TIMEOUT_S = 300
# Far above the family's 0.001, so the aux loss's share of the gradient shows in the grad norms compared.
AUX_COEF = 0.5  # a hang ends as a failed job, well within the test's timeout


def write_rank_split_data(path, n: int = 12, seed: int = 3):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        a, b = rng.randint(1, 9) if i % 3 else rng.randint(100, 999), rng.randint(1, 99)  # 1-4 digit sums
        question = RANK_PROMPTS[i % 2].format(a=a, b=b)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": str(a + b)}]
        lines.append(json.dumps({"messages": messages}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def route_by_rank(model, dataset) -> None:
    """The weights described in the module docstring, in place."""
    ids = [set(dataset[i]["input_ids"].flatten().tolist()) for i in range(len(dataset))]
    rank_ids = [set().union(*ids[r::2]) for r in (0, 1)]
    sign = torch.zeros(model.config.text_config.vocab_size)
    sign[sorted(rank_ids[0] - rank_ids[1])] = SIGN
    sign[sorted(rank_ids[1] - rank_ids[0])] = -SIGN
    for i in range(len(dataset)):  # the causal mean keeps the rank's sign only if it starts the sample
        assert sign[int(dataset[i]["input_ids"].flatten()[0])] == (SIGN if i % 2 == 0 else -SIGN), i
    text = model.model.language_model
    with torch.no_grad():
        text.embed_tokens.weight[:, D] = sign
        for index, layer in enumerate(text.layers):
            o_proj = layer.self_attn.o_proj.weight
            o_proj[D] = 0.0
            if index == 0:  # head 0's first value channel reads D; its output is written back into D
                layer.self_attn.v_proj.weight[0] = 0.0
                layer.self_attn.v_proj.weight[0, D] = 1.0
                o_proj[D, 0] = SIGN
            layer.mlp.experts.down_proj[:, D, :] = 0.0
            router = layer.mlp.gate.weight
            router[:, D] = torch.tensor([4.0, 4.0, -4.0, -4.0])


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ntil_ds.data import ConversationDataset, load_processor
    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("moe")
    folder = build_tiny_model_folder("qwen3_vl_moe", root / "model")
    (folder / "chat_template.jinja").write_text(BARE_TEMPLATE)
    data_file = write_rank_split_data(root / "data" / "train.jsonl")
    dataset = ConversationDataset(data_file, load_processor(folder), max_seq_len=128)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    route_by_rank(model, dataset)
    model.save_pretrained(folder)
    hub_layout(folder / "model.safetensors")
    return root, folder, data_file, dataset


def hub_layout(weights_file) -> None:
    """The experts as Qwen3-VL-MoE's Hub checkpoints store them ([E, in, out]; transformers' own layout
    is [E, out, in]). Under ZeRO-3 transformers 5.24 always transposes them on load: its shape check
    (Transpose(check_dims=True)) reads the partitioned placeholder's shape, so a folder saved in its own
    layout fails to load there (a size mismatch)."""
    weights = load_file(weights_file)
    for name in [n for n in weights if ".mlp.experts." in n]:
        weights[name] = weights[name].transpose(1, 2).contiguous()
    save_file(weights, weights_file, metadata={"format": "pt"})


def moe_overrides(root, folder, data_file, name: str, nproc: int, micro_batch_size: int, **extra) -> dict:
    return {
        "output_dir": root / name,
        "model.name_or_path": folder,
        "model.init": "pretrained",
        "model.dtype": "float32",
        "data.train_file": data_file,
        "data.eval_file": "",
        "data.max_seq_len": 128,
        "data.shuffle": "false",
        "data.fake_image": "false",  # text only on every rank: no rank runs the vision tower
        "loss.name": "ce",  # see test_train_normalization.py: CE's gradient must not depend on the split
        "loss.logits": "all" if nproc == 1 else "labelled",
        "optim.name": "adamw_torch",
        "optim.lr": 0.02,
        "optim.eps": 1.0,
        "optim.grad_clip": 0.0,
        "optim.warmup_steps": 0,
        "train.max_steps": STEPS,
        "train.micro_batch_size": micro_batch_size,
        "train.global_batch_size": 4,
        "train.save_every": 0,
        "train.export_at_end": "true",
        "tracking.enabled": "false",
        "model.router_aux_loss_coef": AUX_COEF,
        **extra,
    }


def run_moe_steps(root, folder, data_file, name: str, nproc: int, micro_batch_size: int, **extra):
    out, probe_dir = root / name, root / f"{name}_probe"
    probe_dir.mkdir(exist_ok=True)
    overrides = moe_overrides(root, folder, data_file, name, nproc, micro_batch_size, **extra)
    env = launch_env(MOE_PROBE_DIR=str(probe_dir))
    result = run_training(overrides, nproc=nproc, script=PROBE_JOB, env=env, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:]
    probes = [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {
        "routes": [p["routes"] for p in probes],
        "aux": [p["aux"] for p in probes],
        "metrics": train_metrics(out),
        # (a LoRA run: its merged export, a plain model)
        "weights": load_file(
            out / "export" / ("merged" if (out / "export" / "merged").exists() else "") / "model.safetensors"
        ),
        "log": result.stdout,
    }


@pytest.fixture(scope="module")
def layouts(moe_setup):
    """Run together: one process, the whole global batch of each step as 4 micro-batches of one sample
    (the same micro-batches as the split run's, since the aux loss of a micro-batch is not additive over
    samples, a product of two means, and so, like NTIL's terms, legitimately depends on the split); and 2
    ZeRO-3 ranks, one sample a micro-batch."""
    root, folder, data_file, _ = moe_setup
    return run_together(
        {
            name: partial(run_moe_steps, root, folder, data_file, name, nproc=nproc, micro_batch_size=1)
            for name, nproc in (("single", 1), ("split", 2))
        }
    )


@pytest.fixture(scope="module")
def reference(layouts):
    return layouts["single"]


@pytest.mark.timeout(900)
def test_disjoint_experts_on_two_zero3_ranks_equal_one_process(moe_setup, layouts, reference):
    _, folder, _, dataset = moe_setup
    split = layouts["split"]

    # The routing the weights force: every forward of rank 0 used experts {0, 1} only, rank 1's {2, 3}
    # (2 layers x 2 micro-batches x STEPS); the one process's forwards alternate between the two.
    layers_per_step = 2 * 2
    assert len(split["routes"][0]) == len(split["routes"][1]) == layers_per_step * STEPS
    assert all(r == [0, 1] for r in split["routes"][0]), split["routes"][0]
    assert all(r == [2, 3] for r in split["routes"][1]), split["routes"][1]
    assert reference["routes"][0] == ([[0, 1]] * 2 + [[2, 3]] * 2) * 2 * STEPS, reference["routes"][0]
    assert "ZeRO-3 leaf modules: Qwen3VLMoeTextExperts" in split["log"]

    initial = {
        n: w.transpose(1, 2) if ".mlp.experts." in n else w
        for n, w in load_file(folder / "model.safetensors").items()
    }
    for step in range(1, STEPS + 1):
        got, want = split["metrics"][step], reference["metrics"][step]
        assert got["labelled_tokens"] == want["labelled_tokens"], step
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), step
        # The aux loss (normalised as the loss is) and the experts' load, logged alike; all four
        # experts took part in every step.
        assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-6) and got["aux_loss"] > 1.0, step
        for key in ("expert_share_min", "expert_share_max", "experts_unused"):
            assert got[key] == want[key], (step, key)
        assert got["experts_unused"] == 0 and got["expert_share_max"] < 0.5, step
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(split["weights"][name], expected, rtol=1e-5, atol=1e-7, msg=name)
    # The logged aux loss is the step's micro-batch aux losses weighted by their labelled tokens over the
    # step's count (not a mean of per-micro-batch values): from each forward's own aux_loss (the probe).
    # Rank r's micro-batch m of step s is sample 4s + 2m + r (data.shuffle=false, stream position r + 2k).
    targets = [int((dataset[i]["targets"] != -100).sum()) for i in range(len(dataset))]
    for step in range(STEPS):
        samples = {(r, m): 4 * step + 2 * m + r for r in (0, 1) for m in (0, 1)}
        weighted = sum(split["aux"][r][2 * step + m] * targets[i] for (r, m), i in samples.items())
        count = sum(targets[i] for i in samples.values())
        assert split["metrics"][step + 1]["aux_loss"] == pytest.approx(weighted / count, rel=1e-6), step
    assert len(set(targets[:4])) > 1  # unequal counts in a step: the weighting matters
    experts = [n for n in initial if ".mlp.experts." in n]
    assert experts and all(not torch.equal(reference["weights"][n], initial[n]) for n in experts)


# LoRA on attention and on the experts (lora.experts: peft's adapters on the fused 3-D weights), under
# ZeRO-2; lr high enough that the adapters move the loss within the 3 steps.
LORA = {
    "lora.enabled": "true",
    "lora.experts": "true",
    "lora.r": 4,
    "lora.alpha": 8,
    "lora.dropout": 0.0,
    "lora.merge_on_export": "true",
    "model.freeze_vision_tower": "true",
    "deepspeed": "configs/deepspeed/zero2.json",
}


@pytest.mark.timeout(1200)
def test_disjoint_experts_zero2_lora_killed_and_resumed_equal_one_process(moe_setup, reference):
    """One 2-rank job serves ZeRO-2, LoRA on the experts and a kill: killed (launcher and workers, as a
    node failure) once its step-1 checkpoint is complete, resumed to the end; every step's loss, grad
    norm and aux loss equal one process's LoRA run on the full batch, the resumed forwards still routed
    apart, and the merged exports equal. Its first step also equals the full fine-tuning reference's
    (the adapters start at zero: the same forward)."""
    root, folder, data_file, _ = moe_setup
    split = {**LORA, "train.save_every": 1}
    overrides = moe_overrides(root, folder, data_file, "lora_split", nproc=2, micro_batch_size=1, **split)
    lora_one = run_together(  # the one-process reference beside the job that is killed
        {
            "one": partial(run_moe_steps, root, folder, data_file, "lora_single", 1, 1, **LORA),
            "killed": partial(
                kill_after_checkpoint, overrides, 1, log_path=root / "lora_killed.log", timeout=JOB_TIMEOUT_S
            ),
        }
    )["one"]
    out = root / "lora_split"
    # The kill lands once step 1's checkpoint is complete, but a fast job can save later ones before it
    # dies (CI saw step 3's): they are removed, so the job always resumes from step 1.
    for later in range(2, STEPS + 1):
        shutil.rmtree(out / "checkpoints" / f"step_{later:08d}", ignore_errors=True)
    resumed = run_moe_steps(root, folder, data_file, "lora_split", nproc=2, micro_batch_size=1, **split)
    assert "resumed from" in resumed["log"]
    assert "LoRA r=4 alpha=8 on 8 linear layers and 4 expert weights" in resumed["log"]
    # The resumed steps: rank 0's forwards used experts {0, 1} only, rank 1's {2, 3}. The kill lands once
    # step 1's checkpoint is complete; the job may have finished step 2's (never STEPS's) before it dies,
    # so the count of resumed steps is read from the log, not assumed.
    start = int(re.search(r"resumed from \S+ \(step (\d+)\)", resumed["log"]).group(1))
    assert 1 <= start < STEPS, start
    layers_per_step = 2 * 2  # 2 micro-batches x 2 MoE layers
    assert len(resumed["routes"][0]) == len(resumed["routes"][1]) == layers_per_step * (STEPS - start)
    assert all(r == [0, 1] for r in resumed["routes"][0]), resumed["routes"][0]
    assert all(r == [2, 3] for r in resumed["routes"][1]), resumed["routes"][1]

    got, want = resumed["metrics"], lora_one["metrics"]
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)
    assert got[STEPS]["loss"] != pytest.approx(got[1]["loss"], rel=1e-3)  # the adapters trained
    for key in ("loss", "aux_loss"):
        assert got[1][key] == pytest.approx(reference["metrics"][1][key], rel=1e-6), key
    assert got[1]["grad_norm"] < reference["metrics"][1]["grad_norm"]  # only the adapters and the head
    for name, expected in lora_one["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], expected, rtol=1e-5, atol=1e-7, msg=name)
    experts = [n for n in lora_one["weights"] if n.endswith(".mlp.experts.gate_up_proj")]
    initial = load_file(folder / "model.safetensors")
    assert experts and all(
        not torch.equal(lora_one["weights"][n], initial[n].transpose(1, 2)) for n in experts
    ), "the merged experts equal the base: the expert adapters did not train"
