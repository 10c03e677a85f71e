"""NTIL in transformers' Trainer and TRL's SFTTrainer (ntil_ds/integrations), one process.

The reference is independent of the adapters: the float64 literal NTIL (ntil_ds/loss/reference.py) on the
model's own logits of the very micro-batches the trainer draws, each micro-batch's summed loss over the
step's count of targets, differentiated by autograd. The trainer's logged first-step loss, grad norm and
parts must equal it: a wrong shift, a wrong normalisation under gradient accumulation, or parts that do not
reach the logs fail here. (Under DeepSpeed ZeRO-3 on 2 ranks: tests/distributed/test_integrations_trainer.py.)
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from ntil_ds.config import ConfigError
from ntil_ds.integrations import attach_ntil, ntil_loss
from ntil_ds.loss import GroupedNTILLoss, NTILLoss, digit_token_ids_from_tokenizer
from ntil_ds.loss.reference import reference_ntil_loss
from tests.unit.test_loss_tokenizer_probe import FROM_THE_RIGHT, LLAMA3, _tokenizer

LOSS_KEYS = {"ntil_lambda": 0.3, "gumbel_noise_scale": 0.0, "kernel": "torch", "number_stage": "eager"}
MICRO, ACCUMULATE = 2, 2


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ntil_ds.tiny import build_tiny_model_folder

    folder = build_tiny_model_folder("qwen2", tmp_path_factory.mktemp("hf") / "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).save_pretrained(
        folder
    )
    return folder, AutoTokenizer.from_pretrained(folder)


def sums(n: int) -> list[tuple[str, str]]:
    """Prompt and answer texts of ragged lengths, numbers of 1 to 4 digits in the answers."""
    return [
        (f"What is {7 * i + 3} plus {11 * i * i}?", f" It is {7 * i + 3 + 11 * i * i}.") for i in range(n)
    ]


def tokenized(tokenizer, n: int) -> list[dict[str, list[int]]]:
    rows = []
    for prompt, answer in sums(n):
        p, a = tokenizer(prompt)["input_ids"], tokenizer(answer)["input_ids"]
        rows.append({"input_ids": p + a, "labels": [-100] * len(p) + a})
    return rows


def training_args(tmp_path, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATE,
        max_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[],
        max_grad_norm=1e9, train_sampling_strategy="sequential", use_cpu=True, save_strategy="no", seed=0,
        **extra,
    )  # fmt: skip


def reference_step(model, batches: list[dict[str, torch.Tensor]], digit_ids) -> dict[str, float]:
    """First step's loss, grad norm and parts by the float64 literal NTIL on each micro-batch's logits."""
    model.zero_grad()
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    loss, parts = 0.0, {"ce_sum": 0.0, "emd": 0.0, "rel": 0.0, "mag": 0.0, "ntil": 0.0}
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
        targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        out = reference_ntil_loss(logits, targets, digit_ids, **{"ntil_lambda": LOSS_KEYS["ntil_lambda"]})
        count = int((targets != -100).sum())
        loss = loss + out["loss"] * count / total
        parts["ce_sum"] += float(out["ce_mean"]) * count
        for name in ("emd", "rel", "mag", "ntil"):
            parts[name] += float(out[name]) / len(batches)
    loss.backward()
    grad_norm = math.sqrt(
        sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    )
    model.zero_grad()
    ce = parts.pop("ce_sum") / total
    return {"loss": float(loss), "grad_norm": grad_norm, "ce": ce, **parts}


def assert_logged_as(logged: dict, expected: dict) -> None:
    for name in ("loss", "grad_norm", "ce", "emd", "rel", "mag", "ntil"):
        assert logged[name] == pytest.approx(expected[name], rel=2e-5, abs=1e-7), name


def test_ntil_loss_is_the_recipes_loss_and_refuses_what_the_recipe_refuses(tiny_qwen2):
    _, tokenizer = tiny_qwen2
    imports = (
        "import sys; from ntil_ds import ntil_loss, NTILLoss, attach_ntil; print('deepspeed' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True).stdout.strip()
        == "False"
    )
    loss = ntil_loss(tokenizer, **LOSS_KEYS)
    assert type(loss) is NTILLoss and loss.ntil_lambda == 0.3 and loss.kernel == "torch"
    assert loss.digit_token_ids == digit_token_ids_from_tokenizer(tokenizer)
    assert (
        ntil_loss(tokenizer, **{"loss.name": "emd"}).abs_alpha == 0.0
    )  # the recipe's emd: no sequence terms
    torch.manual_seed(1)
    logits = torch.randn(2, 9, len(tokenizer), dtype=torch.float64)
    digits = loss.digit_token_ids
    targets = torch.tensor(
        [
            [-100, digits[3], digits[1], 5, -100, digits[4], 6, -100, -100],
            [-100] * 5 + [digits[9], digits[0], 7, -100],
        ]
    )
    got = loss(logits, targets)
    want = reference_ntil_loss(logits, targets, digits, ntil_lambda=0.3)
    for name in ("loss", "emd", "rel", "mag", "ntil", "ce_mean"):
        torch.testing.assert_close(getattr(got, name), want[name], rtol=1e-12, atol=1e-12, msg=name)
    with pytest.raises(
        ConfigError, match="unknown config key 'loss.ntil_lamda'.*did you mean 'loss.ntil_lambda'"
    ):
        ntil_loss(tokenizer, ntil_lamda=0.3)

    # grouped-digit tokenizers get the grouped loss; one grouping from the right is refused, saying so
    assert type(ntil_loss(_tokenizer(LLAMA3, "tiny-llama3"))) is GroupedNTILLoss
    with pytest.raises(ConfigError, match="loss.name=ntil: .*grouped from the right"):
        ntil_loss(_tokenizer(FROM_THE_RIGHT, "tiny-right"))


@pytest.mark.parametrize(("head", "shifted"), [("logits", False), ("labelled", False), ("labelled", True)])
def test_trainer_with_accumulation_logs_the_reference_loss_grad_norm_and_parts(
    tiny_qwen2, tmp_path, head, shifted
):
    """``shifted``: the collator hands over ``shift_labels`` (aligned already, as padding-free collators do)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer

    folder, tokenizer = tiny_qwen2
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True)
    rows = tokenized(tokenizer, MICRO * ACCUMULATE)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path),
        train_dataset=Dataset.from_list(rows),
        data_collator=collator,
    )
    hook = attach_ntil(trainer, tokenizer, head=head, **LOSS_KEYS)
    batches = [collator(rows[i : i + MICRO]) for i in range(0, len(rows), MICRO)]
    expected = reference_step(model, batches, hook.loss.digit_token_ids)
    trainer.train()
    assert_logged_as(trainer.state.log_history[0], expected)


@pytest.mark.parametrize("head", ["logits", "labelled"])
def test_sft_trainer_trains_ntil_and_logs_the_reference_parts(tiny_qwen2, tmp_path, head):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    folder, tokenizer = tiny_qwen2
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p, "completion": a} for p, a in sums(MICRO * ACCUMULATE)])
    args = training_args(tmp_path).to_dict()
    args = {k: v for k, v in args.items() if k in SFTConfig.__dataclass_fields__ and not k.startswith("_")}
    config = SFTConfig(**{**args, "output_dir": str(tmp_path / "sft"), "completion_only_loss": True})
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    hook = attach_ntil(trainer, tokenizer, head=head, **LOSS_KEYS)
    loader = trainer.get_train_dataloader()
    batches = [{k: v for k, v in b.items()} for b, _ in zip(loader, range(ACCUMULATE), strict=False)]
    expected = reference_step(model, batches, hook.loss.digit_token_ids)
    trainer.train()
    assert_logged_as(trainer.state.log_history[0], expected)
    with pytest.raises(ValueError, match="loss_type='nll'"):
        attach_ntil(SFTTrainer(model=model, args=SFTConfig(**{**args, "loss_type": "dft"}), train_dataset=data,
                               processing_class=tokenizer), tokenizer)  # fmt: skip


def test_evaluation_logs_the_eval_parts_alike_on_both_routes(tiny_qwen2, tmp_path):
    """Evaluation through either route: the same eval loss and eval_-prefixed parts (the labelled head
    returns the loss without logits)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer

    folder, tokenizer = tiny_qwen2
    rows = Dataset.from_list(tokenized(tokenizer, MICRO * ACCUMULATE))
    logged = {}
    for head in ("logits", "labelled"):
        args = training_args(
            tmp_path / head, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=MICRO
        )
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                          data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True))  # fmt: skip
        attach_ntil(trainer, tokenizer, head=head, **LOSS_KEYS)
        trainer.train()
        (logged[head],) = [record for record in trainer.state.log_history if "eval_loss" in record]
    for name in ("eval_loss", "eval_ce", "eval_emd", "eval_rel", "eval_mag", "eval_ntil"):
        assert logged["labelled"][name] == pytest.approx(logged["logits"][name], rel=1e-5), name
    # the Trainer's eval_loss is a mean over batches of (1 + lambda) x each batch's CE; eval_ce is over tokens
    assert (
        1.2 * logged["logits"]["eval_ce"] < logged["logits"]["eval_loss"] < 1.4 * logged["logits"]["eval_ce"]
    )
