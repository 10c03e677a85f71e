"""One typed configuration tree for a training run.

Precedence: dataclass defaults < YAML recipe < command-line ``key=value`` overrides.
Loading is strict: an unknown key, a value of the wrong type or a value outside a fixed set of choices
is an error that names the key (with a "did you mean" hint), raised before any process group,
model or data is touched. There is deliberately no ``cfg.get(key, default)`` anywhere: every field
exists, typed, with its default written once, here.

Checks that need the world size (batch divisibility) or another file (the DeepSpeed JSON) live with
the code that knows those things, and raise :class:`ConfigError` too.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ntil_ds.config_lora import validate_lora
from ntil_ds.config_parallel import ParallelConfig, validate_parallel
from ntil_ds.typed_config import ConfigError, apply_override, build


@dataclass
class ModelConfig:
    # A Hugging Face hub id or a local folder. With init="random" only its config.json and processor
    # files are read (the tiny CI/demo models are folders written by launch/make_tiny_model.py).
    name_or_path: str = ""
    init: Literal["pretrained", "random"] = "pretrained"
    # "auto" picks AutoModelForImageTextToText when the config has a vision part, else CausalLM.
    kind: Literal["auto", "mllm", "llm"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # "auto": flash_attention_2 when flash-attn is importable (and CUDA is there), else sdpa.
    # "flex_attention" (CUDA only: torch 2.13 has no FlexAttention backward on CPU; not the Qwen-VL
    # classes of transformers 5.24): a BlockMask of the packed documents instead of sdpa's dense mask.
    # Not auto's choice until a GPU has measured it (python -m benchmarks.attention_speed --device cuda).
    attn_implementation: Literal["auto", "flash_attention_2", "flex_attention", "sdpa", "eager"] = "auto"
    gradient_checkpointing: bool = False
    freeze_vision_tower: bool = False
    freeze_projector: bool = False
    freeze_language_model: bool = False
    trust_remote_code: bool = False
    # Where the processor/tokenizer comes from; empty means name_or_path.
    processor: str = ""
    # Fused kernels patched in at load time (ntil_ds/model/kernels.py): "liger" = Liger-Kernel's RMSNorm,
    # SwiGLU MLP and rotary embedding for the model kinds it supports (needs the gpu extra: liger-kernel).
    kernels: Literal["none", "liger"] = "none"
    # Mixture of experts: the router's load-balancing loss coefficient (ntil_ds/moe.py); unset: the
    # checkpoint's own router_aux_loss_coef (Qwen3-VL-MoE: 0.001); 0 logs the loss without training it.
    router_aux_loss_coef: float | None = None
    # Mixture of experts: how transformers runs the fused experts (ntil_ds/model/experts.py): eager (a loop
    # over the experts), batched_mm, grouped_mm; auto: the fastest measured on the device (grouped_mm on
    # CPU and CUDA sm80+). The resolved one is logged as the run parameter model.experts_implementation_resolved.
    experts_implementation: Literal["auto", "eager", "batched_mm", "grouped_mm"] = "auto"


@dataclass
class LoraConfig:
    """LoRA (ntil_ds/model/lora.py) / QLoRA (ntil_ds/model/quantize.py). Off by default: full fine-tuning."""

    enabled: bool = False
    r: int = 16
    alpha: float = 32.0  # adapter output scaled by alpha / r
    dropout: float = 0.05
    # Comma-separated layer names inside the language model, or "all-linear" (never the vision tower).
    target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    # What of the output head trains. full: every row, saved with the adapter (peft's modules_to_save;
    # tied embeddings train with it); frozen: nothing (NTIL's gradient still reaches the adapters through
    # it); number_rows: only the rows of the tokens NTIL reads (the ten digits, and '-' / '.' when
    # loss.signed_numbers / loss.decimal_numbers), as a small delta saved with the adapter and merged on
    # export (ntil_ds/model/head_rows.py).
    head: Literal["full", "frozen", "number_rows"] = "full"
    # Comma-separated modules besides the head trained in full and saved with the adapter (the projector
    # is added when model.freeze_projector=false). lm_head here is the old spelling of lora.head=full.
    modules_to_save: str = ""
    # nf4: QLoRA, the language model's frozen linear weights loaded in 4 bits (bitsandbytes); the head,
    # projector and vision tower stay 16-bit (ntil_ds/model/quantize.py). ZeRO-2 and ZeRO-3.
    quantize: Literal["none", "nf4"] = "none"
    # Also write export/merged/: base + adapters merged, loads with plain from_pretrained.
    merge_on_export: bool = False
    # Mixture of experts: also adapters on the fused experts' 3-D weights (gate_up_proj, down_proj: one
    # low-rank delta per expert, peft's target_parameters). Off: adapters on attention only, experts frozen.
    # Needs lora.dropout=0 (peft cannot apply dropout to a weight delta) and lora.quantize=none.
    experts: bool = False


@dataclass
class LossConfig:
    # ntil: CE + NTIL (the paper); ce: plain cross-entropy (NTIL parts still logged, no gradient);
    # emd: NTIL without its sequence-level terms (the paper's EMD-only baseline); ntl: CE + ntl_lambda x
    # the Wasserstein Number Token Loss of the optional `ntloss` package (a peer to compare against).
    name: Literal["ntil", "ce", "emd", "ntl"] = "ntil"
    ntil_lambda: float = 0.3
    ntl_lambda: float = 0.3
    # loss.name=ntl: ntloss's digit_level. True (its default, the ICML paper's): only the tokens "0".."9"
    # are number tokens; False: every token that parses as a number ("123", "007") is one, scored by its
    # own value whatever its place in the number.
    ntl_digit_level: bool = True
    digit_alpha: float = 1.0
    abs_alpha: float = 0.2
    mag_alpha: float = 0.2
    digit_exp: float = 1.2
    gumbel_tau: float = 0.1
    gumbel_noise_scale: float = 0.01
    decimal_numbers: bool = False
    signed_numbers: bool = False
    # Ablations (docs/loss.md; off: the paper). ntil_lambda_ramp_steps: ntil_lambda rises linearly from 0 at
    # step 0 to its value at this optimizer step. ntil_ratio: sg(CE / NTIL) per micro-batch (the paper) or
    # per sample (each sample's NTIL rescaled to its own CE).
    ntil_lambda_ramp_steps: int = 0
    ntil_ratio: Literal["batch", "sample"] = "batch"
    # How the loss is computed, not what (same numbers within float rounding; docs/loss.md). kernel: the
    # vocabulary stage; auto = the fused Triton kernels for CUDA logits when triton imports, else the torch
    # tiles; torch / triton force one (triton fails without Triton).
    kernel: Literal["auto", "torch", "triton"] = "auto"
    # number_stage: the per-digit/per-number terms; auto = the Triton number kernels on CUDA when triton
    # imports (one launch each way, deterministic), else eager; eager = the torch ops as written; compile =
    # those through torch.compile (compiled once at the first step, ~tens of seconds); triton forces the
    # kernels (fails without Triton).
    number_stage: Literal["auto", "eager", "compile", "triton"] = "auto"
    # logits: labelled runs the output head only at the positions with a target, in chunks fused with the
    # loss (no full-vocabulary logits tensor; ntil_ds/labelled_forward.py); all asks the model for its
    # logits everywhere (for comparison; loss.name=ntl always reads them, ntloss needs every row).
    logits: Literal["labelled", "all"] = "labelled"


@dataclass
class MixtureSource:
    """One entry of data.mixture: a data file (or folder) and its share of each epoch."""

    file: str = ""
    weight: float = 1.0


@dataclass
class DataConfig:
    # A JSONL file, a .parquet file, a folder of .parquet shards or a save_to_disk folder (docs/data.md).
    train_file: str = ""
    # Instead of train_file: several sources, each a share of every epoch proportional to its weight
    # (ntil_ds/data/weighted.py, docs/data.md), e.g. [{file: a.jsonl, weight: 0.7}, {file: b.parquet, weight: 0.3}].
    mixture: list[MixtureSource] = field(default_factory=list)
    eval_file: str = ""  # empty: no evaluation during training
    max_seq_len: int = 2048
    on_bad_sample: Literal["error", "skip"] = "error"
    shuffle: bool = True
    num_workers: int = 0
    # ZeRO-3 needs every rank to run the vision tower each step: a micro-batch without an image gets a
    # tiny fake one, masked out of attention and labels.
    fake_image: bool = True
    # Sequence packing (ntil_ds/data/packing.py): > 0 packs each rank's samples of a step, in order, into
    # micro-batches of one row of at most this many tokens (attention never crosses samples; exact, see
    # docs/training.md). An optimizer step still takes train.global_batch_size samples; the number of
    # forwards per step then follows from the tokens (train.micro_batch_size is not used for batching).
    # Must be >= data.max_seq_len. 0: no packing, train.micro_batch_size padded rows per forward.
    max_tokens_per_micro_batch: int = 0
    # Encode once (ntil_ds/data/cache.py): the first start writes the encoded samples as memory-mapped
    # arrays, every rank and later start maps them. false: every rank encodes every line at every start.
    cache: bool = True
    # Where caches live. Empty: .ntil_cache beside the data file, or under output_dir when the data
    # folder is read-only.
    cache_dir: str = ""
    # A first build split over processes (ntil_ds/data/parallel_build.py): with several ranks, the node's
    # ranks share it; with one rank, this many worker processes. 0: as many as the CPUs this process may
    # use (at most 8), from 50,000 lines (a worker takes seconds to start); 1: in the process itself.
    encode_workers: int = 0


@dataclass
class OptimConfig:
    # adamw: DeepSpeed's FusedAdam (CPUAdam under optimizer offload), JIT-compiled at deepspeed.initialize
    # unless prebuilt (nvcc/ninja, minutes); adamw_torch: DeepSpeed's AdamW entry with torch_adam=true, i.e.
    # torch.optim.AdamW: nothing compiles (the GPU recipes' choice, with fused=true, and the CPU's);
    # adamw_8bit: bitsandbytes AdamW8bit.
    name: Literal["adamw", "adamw_torch", "adamw_8bit"] = "adamw"
    # adamw_torch only: torch's fused AdamW kernel (one launch per step on CUDA, also on the CPU's offloaded
    # states) instead of its default foreach implementation, which is what DeepSpeed builds otherwise.
    fused: bool = False
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio at train.max_steps
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class TrainConfig:
    max_steps: int = 100  # optimizer steps
    micro_batch_size: int = 1  # per data-parallel rank, per forward
    # Sequences per optimizer step over all data-parallel ranks; gradient accumulation is derived:
    # global_batch_size / (micro_batch_size * data_parallel_size), which must divide exactly.
    global_batch_size: int = 8
    seed: int = 42
    log_every: int = 1
    eval_every: int = 0  # 0: no evaluation during training
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2  # checkpoints kept on disk (the newest ones)
    export_at_end: bool = True  # write a Hugging Face folder to <output_dir>/export


@dataclass
class EvalConfig:
    """Numeric metrics while training (ntil_ds/evaluation/numeric.py): greedy answers to the first
    ``generate_samples`` lines of data.eval_file, scored with the task's metrics (ntil_ds/scoring.py) and
    logged as eval/<metric>. Teacher-forced accuracies keep their own cadence, train.eval_every."""

    generate_every: int = 0  # optimizer steps between evaluations; 0: off. On, the last step is evaluated too
    generate_samples: int = 64  # the fixed subset: the first lines of data.eval_file
    max_new_tokens: int = 32
    batch_size: int = 16  # prompts per generate call on each data-parallel rank
    task: str = ""  # clock, boxes, chart, arithmetic ...; empty: the eval lines' "task" key


@dataclass
class TrackingConfig:
    enabled: bool = True
    # Empty: MLFLOW_TRACKING_URI if set, else sqlite:///<output_dir>/mlflow.db (embedded store).
    # Credentials: MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN in the environment (docs/tracking.md);
    # a user:password@ in the URI is taken the same way and never written (redact_uri).
    uri: str = ""
    experiment: str = "ntil-ds"
    run_name: str = ""  # empty: derived from the recipe name and start time
    # True: an unreachable tracking server at start is an error. False: training goes on and metrics
    # are buffered/written to a local fallback store.
    required: bool = False
    system_metrics: bool = False
    log_model: bool = False  # log the exported Hugging Face folder as an artifact


@dataclass
class Config:
    output_dir: str = "outputs/run"
    # DeepSpeed tuning JSON (ZeRO stage, offload, buckets, tensor parallel). Batch sizes, accumulation,
    # clipping, precision and the optimizer come from this recipe; a JSON that contradicts them is an
    # error.
    deepspeed: str = "configs/deepspeed/zero3.json"
    # auto: newest complete checkpoint in output_dir if any, else start fresh; none; or a checkpoint path.
    resume: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# ----------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a :class:`Config` from a YAML recipe (or only defaults if ``path`` is None) and overrides.

    Each override is ``dotted.key=value``; the value is parsed as YAML (``true``, ``3``, ``1e-5``,
    ``[1, 2]``, strings as they are).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe {path} does not exist (give a YAML file from configs/train/)")
        with path.open() as f:
            loaded = yaml.safe_load(f)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"recipe {path} must be a YAML mapping, got {type(loaded).__name__}")
        raw = loaded
    for override in overrides:
        apply_override(raw, override)
    cfg = build(Config, raw)
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------------
# Validation that needs only the config itself


def validate(cfg: Config) -> None:
    """Cross-field checks. World-size dependent checks: :func:`gradient_accumulation_steps`."""
    if not cfg.model.name_or_path:
        raise ConfigError("model.name_or_path is required (a hub id or a local model folder)")
    if not cfg.data.train_file and not cfg.data.mixture:
        raise ConfigError(
            "data.train_file is required (a JSONL file, a .parquet file, a folder of .parquet shards or a "
            "save_to_disk folder; see docs/data.md), or data.mixture (several of them, with weights)"
        )
    if cfg.data.train_file and cfg.data.mixture:
        raise ConfigError("give data.train_file or data.mixture, not both")
    for i, source in enumerate(cfg.data.mixture):
        if not source.file or not source.weight > 0:
            raise ConfigError(f"data.mixture[{i}] needs a file and a weight > 0, got {source}")
    positive = {
        "train.max_steps": cfg.train.max_steps,
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.global_batch_size": cfg.train.global_batch_size,
        "train.log_every": cfg.train.log_every,
        "train.keep_last": cfg.train.keep_last,
        "data.max_seq_len": cfg.data.max_seq_len,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be > 0")
    non_negative = {
        "train.eval_every": cfg.train.eval_every,
        "train.save_every": cfg.train.save_every,
        "optim.warmup_steps": cfg.optim.warmup_steps,
        "optim.grad_clip": cfg.optim.grad_clip,
        "optim.weight_decay": cfg.optim.weight_decay,
        "loss.ntil_lambda": cfg.loss.ntil_lambda,
        "loss.ntl_lambda": cfg.loss.ntl_lambda,
        "loss.ntil_lambda_ramp_steps": cfg.loss.ntil_lambda_ramp_steps,
        "data.num_workers": cfg.data.num_workers,
        "data.encode_workers": cfg.data.encode_workers,
        "data.max_tokens_per_micro_batch": cfg.data.max_tokens_per_micro_batch,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0")
    ablation = cfg.loss.ntil_lambda_ramp_steps > 0 or cfg.loss.ntil_ratio != "batch"
    if ablation and cfg.loss.name in ("ce", "ntl"):
        raise ConfigError(
            f"loss.ntil_lambda_ramp_steps / loss.ntil_ratio shape NTIL's weight; loss.name={cfg.loss.name} "
            "trains none: set loss.ntil_lambda_ramp_steps=0 loss.ntil_ratio=batch (or loss.name=ntil / emd)"
        )
    if cfg.loss.ntil_lambda_ramp_steps > cfg.train.max_steps:
        raise ConfigError(
            f"loss.ntil_lambda_ramp_steps={cfg.loss.ntil_lambda_ramp_steps} exceeds train.max_steps="
            f"{cfg.train.max_steps}: ntil_lambda would never reach its value; lower it"
        )
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be > 0")
    if cfg.optim.fused and cfg.optim.name != "adamw_torch":
        raise ConfigError(
            f"optim.fused=true is torch's fused AdamW, for optim.name=adamw_torch, not {cfg.optim.name!r} "
            "(with another optim.name, also set optim.fused=false)"
        )
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]")
    if cfg.optim.warmup_steps > cfg.train.max_steps:
        raise ConfigError(
            f"optim.warmup_steps={cfg.optim.warmup_steps} exceeds train.max_steps={cfg.train.max_steps}"
        )
    if 0 < cfg.data.max_tokens_per_micro_batch < cfg.data.max_seq_len:
        raise ConfigError(
            f"data.max_tokens_per_micro_batch={cfg.data.max_tokens_per_micro_batch} is below "
            f"data.max_seq_len={cfg.data.max_seq_len}: the longest sample would not fit a micro-batch; "
            "raise it (or set it to 0 to turn packing off)"
        )
    if cfg.loss.name == "ntl" and cfg.data.max_tokens_per_micro_batch:
        raise ConfigError("loss.name=ntl does not support packing: set data.max_tokens_per_micro_batch=0")
    if cfg.train.eval_every and not cfg.data.eval_file:
        raise ConfigError("train.eval_every > 0 needs data.eval_file (or set train.eval_every=0)")
    if cfg.eval.generate_every and not cfg.data.eval_file:
        raise ConfigError("eval.generate_every > 0 needs data.eval_file (or set eval.generate_every=0)")
    for key in ("generate_every", "generate_samples", "max_new_tokens", "batch_size"):
        value = getattr(cfg.eval, key)
        if value < 0 or (value == 0 and key != "generate_every"):
            raise ConfigError(f"eval.{key}={value} must be {'>= 0' if key == 'generate_every' else '> 0'}")
    if cfg.model.freeze_vision_tower and cfg.model.freeze_projector and cfg.model.freeze_language_model:
        raise ConfigError("model.freeze_* are all true: nothing would train")
    validate_lora(cfg)  # ntil_ds/config_lora.py
    validate_parallel(cfg)  # ntil_ds/config_parallel.py


def gradient_accumulation_steps(cfg: Config, data_parallel_size: int) -> int:
    """global_batch_size / (micro_batch_size * data-parallel ranks), which must be a whole number."""
    per_pass = cfg.train.micro_batch_size * data_parallel_size
    if cfg.train.global_batch_size % per_pass:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
            f"train.micro_batch_size={cfg.train.micro_batch_size} x {data_parallel_size} data-parallel "
            f"ranks = {per_pass}; choose a global batch that is a multiple of {per_pass}"
        )
    return cfg.train.global_batch_size // per_pass


# ----------------------------------------------------------------------------------------------------
# Output


# scheme://userinfo@ : the userinfo runs to the last @ before the host's end (/ ? # or a space).
_URI_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


def redact_uri(text: str) -> str:
    """``text`` with the userinfo (credentials) of every URI in it removed:
    ``https://user:token@host:5000/x`` -> ``https://host:5000/x``.

    Whatever the project writes or prints that may hold a URI goes through this: the resolved config
    (config.yaml, MLflow params), tracking's log lines and the comparison outputs.
    """
    return _URI_USERINFO.sub(r"\1", text)


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as it may be written or shown: credentials in URIs removed (:func:`redact_uri`)."""

    def shown(value: Any) -> Any:
        if isinstance(value, str):
            return redact_uri(value)
        if isinstance(value, dict):
            return {key: shown(item) for key, item in value.items()}
        if isinstance(value, list):
            return [shown(item) for item in value]
        return value

    return shown(dataclasses.asdict(cfg))


def flatten(cfg: Config) -> dict[str, Any]:
    """``{"model.name_or_path": ..., "loss.ntil_lambda": ...}``: one entry per field (MLflow params)."""
    flat: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(to_dict(cfg), "")
    return flat


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as YAML; loading that file gives back an equal Config (less the
    credentials of a URI, which are never written: :func:`to_dict`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path
