"""The memory estimator against independent references: DeepSpeed's own ZeRO estimators, defaults and
parameter counting, tensors a real tiny model saves for backward, the published sizes of the flagship
models. (The numbers written in the recipes' headers are checked too, as a snapshot of the estimator's
own earlier output: they keep the recipes honest, they are no reference for the formulas.)"""

import re

import pytest
import torch

from ntil_ds.config import load_config
from ntil_ds.memory_estimate import (
    CUDA_CONTEXT_GIB,
    FRAGMENTATION,
    GIB,
    NTIL_PEAK_OVER_LOGITS,
    activation_bytes_per_token,
    count_parameters,
    estimate,
    hf_config_for,
)
from ntil_ds.model.known_configs import KNOWN_CONFIGS
from ntil_ds.tiny import build_tiny_model_folder
from tests.conftest import REPO_ROOT

RECIPES = sorted((REPO_ROOT / "configs" / "train").glob("*.yaml"))


def _cfg(model, *overrides):
    return load_config(None, [f"model.name_or_path={model}", "data.train_file=x", *overrides])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_mem")
    return {
        kind: build_tiny_model_folder(kind, root / kind)
        for kind in ("qwen2_vl", "gemma3", "internvl", "smolvlm")
    }


@pytest.mark.parametrize("kind", ["qwen2_vl", "gemma3", "internvl", "smolvlm"])
def test_parameter_counts_equal_deepspeeds_count_of_the_real_model(tiny, kind):
    from deepspeed.runtime.zero.stage3 import model_to_params
    from transformers import AutoConfig, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tiny[kind]))
    total, largest = model_to_params(model)  # tied weights once, as DeepSpeed counts them
    counts, _ = count_parameters(_cfg(tiny[kind]))
    assert (counts.total, counts.largest_module, counts.trainable) == (total, largest, total)


# Published sizes (model cards / config.json totals), billions of parameters.
PUBLISHED_B = {
    "Qwen/Qwen2-VL-2B-Instruct": 2.21,
    "Qwen/Qwen2-VL-7B-Instruct": 8.29,
    "Qwen/Qwen2.5-VL-7B-Instruct": 8.29,
    "Qwen/Qwen3-VL-8B-Instruct": 8.77,
    # the Hub page's 31.1B (rounded): the language model is Qwen3-30B-A3B's 30.53B, the tower Qwen3-VL's
    "Qwen/Qwen3-VL-30B-A3B-Instruct": 31.07,
    "google/gemma-3-4b-it": 4.30,
    "OpenGVLab/InternVL3-8B-hf": 7.94,
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": 2.25,
    "llava-hf/llava-1.5-7b-hf": 7.06,
    "Qwen/Qwen2.5-7B-Instruct": 7.62,
    # model cards: "35B" / "27B" / "108B" total; these are our counts of the shipped dimensions (offline:
    # not checked against the Hub's safetensors totals, which include the MTP layers transformers drops)
    "Qwen/Qwen3.5-35B-A3B": 35.107,
    "Qwen/Qwen3.5-27B": 27.357,
    "zai-org/GLM-4.5V": 107.711,
    # the Hub pages' 10.7B / 24.0B / 10.3B (safetensors totals, rounded)
    "meta-llama/Llama-3.2-11B-Vision-Instruct": 10.670,
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": 24.011,
    "zai-org/GLM-4.1V-9B-Thinking": 10.293,
    # model card: 109B total with the vision tower; the text model alone (model.kind=llm, all Llama 4 trains
    # in transformers 5.24): our count of the shipped dimensions
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": 107.770,
}
# Checkpoints whose MLLM class is refused (transformers 5.24's Llama 4): counted as the text model.
KIND = {"meta-llama/Llama-4-Scout-17B-16E-Instruct": "llm"}


@pytest.mark.parametrize("name", sorted(KNOWN_CONFIGS))
def test_shipped_dimensions_give_the_published_sizes(name):
    counts, _ = count_parameters(_cfg(name, f"model.kind={KIND.get(name, 'auto')}"))
    assert counts.total / 1e9 == pytest.approx(PUBLISHED_B[name], abs=0.006)


@pytest.mark.parametrize(
    ("ds_json", "gpus"),
    [
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_prefetch_bucket_size": 0,
                    "stage3_max_live_parameters": 0,
                }
            },
            4,
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_prefetch_bucket_size": 0,
                    "stage3_max_live_parameters": 0,
                }
            },
            16,
        ),
        ({"zero_optimization": {"stage": 2}}, 8),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 8),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_prefetch_bucket_size": 0,
                    "stage3_max_live_parameters": 0,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "cpu"},
                }
            },
            8,
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_prefetch_bucket_size": 0,
                    "stage3_max_live_parameters": 0,
                    "offload_optimizer": {"device": "cpu"},
                }
            },
            8,
        ),
    ],
)
def test_full_fine_tuning_model_states_equal_deepspeeds_estimators(ds_json, gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    cfg = _cfg("Qwen/Qwen2-VL-7B-Instruct")  # every parameter trains
    result = estimate(cfg, ds_json, gpus=gpus, gpu_memory_gb=80)
    c = result.counts
    assert c.trainable == c.total
    zero = ds_json["zero_optimization"]
    offload_opt, offload_par = "offload_optimizer" in zero, "offload_param" in zero
    if zero["stage"] == 3:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            c.total,
            c.largest_module,
            num_gpus_per_node=gpus,
            cpu_offload=offload_opt,
            cpu_offload_params=offload_par,
        )
    else:
        _, gpu = estimate_zero2_model_states_mem_needs(
            c.total, num_gpus_per_node=gpus, cpu_offload=offload_opt
        )
    assert result.model_states() == pytest.approx(gpu, rel=1e-9, abs=2)


@pytest.mark.parametrize(
    ("zero", "gpus"),
    [
        ({"stage": 3}, 4),  # DeepSpeed's defaults: 1e9 live parameters, a 5e7 prefetch bucket
        ({"stage": 3}, 16),
        ({"stage": 3, "stage3_max_live_parameters": 3e8, "stage3_prefetch_bucket_size": 2e7}, 8),
    ],
)
def test_zero3_live_parameters_by_hand(zero, gpus):
    """ZeRO-3 keeps gathered, besides each rank's partitions: up to stage3_max_live_parameters in bf16
    (but at least the largest module with its gradient, DeepSpeed's estimators' 4 L) plus the prefetch
    bucket in bf16. Computed here by hand from DeepSpeed's config defaults; the partitions (18 P / N) are
    DeepSpeed's own estimator with no largest-layer term."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    defaults = DeepSpeedZeroConfig()
    assert (defaults.max_live_parameters, defaults.prefetch_bucket_size) == (1_000_000_000, 50_000_000)
    cfg = _cfg("Qwen/Qwen2-VL-2B-Instruct")  # 2.2 B parameters, every one trains
    result = estimate(cfg, {"zero_optimization": zero}, gpus=gpus, gpu_memory_gb=80)
    total, largest = result.counts.total, result.counts.largest_module
    _, partitions, _ = estimate_zero3_model_states_mem_needs(
        total, 0, num_gpus_per_node=gpus, cpu_offload=False, cpu_offload_params=False
    )
    if "stage3_max_live_parameters" in zero:  # 2 B x 3e8 = 0.6 GB is below 4 L = 0.93 GB: the floor holds
        assert 4 * largest > 2 * 3e8
        live = 4 * largest + 2 * 2e7
    else:  # 2 B x 1e9 = 2 GB (the model has more than 1e9 parameters) is above 4 L = 0.93 GB
        assert total > 1e9 and 4 * largest < 2e9
        live = 2 * 1e9 + 2 * 5e7
    assert result.zero3_live_parameters == pytest.approx(live, rel=1e-12)
    assert result.model_states() == pytest.approx(partitions + live, rel=1e-9, abs=2)


def test_lora_and_qlora_shrink_what_they_should():
    name = "Qwen/Qwen3-VL-8B-Instruct"
    ds = {"zero_optimization": {"stage": 3}}
    full = estimate(_cfg(name, "model.freeze_vision_tower=true"), ds, gpus=2, gpu_memory_gb=48)
    lora = estimate(
        _cfg(name, "model.freeze_vision_tower=true", "lora.enabled=true"), ds, gpus=2, gpu_memory_gb=48
    )
    qlora = estimate(
        _cfg(name, "model.freeze_vision_tower=true", "lora.enabled=true", "lora.quantize=nf4"),
        ds,
        gpus=2,
        gpu_memory_gb=48,
    )
    # LoRA trains the adapters, lm_head (4096 x 151936) and the projectors: under 10 % of the model
    assert lora.counts.trainable < 0.1 * full.counts.trainable
    # + adapters, and the trained copies of lm_head and the projectors (peft keeps the originals)
    assert full.weights < lora.weights < 1.1 * full.weights
    assert lora.optimizer_states < 0.1 * full.optimizer_states
    assert qlora.counts.trainable == lora.counts.trainable
    # 4-bit: exactly the language model's attention and MLP matrices; the vision tower, projectors,
    # embeddings and head stay 16-bit.
    text = hf_config_for(name).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    attention = 2 * text.hidden_size * head_dim * (text.num_attention_heads + text.num_key_value_heads)
    assert qlora.counts.quantized == text.num_hidden_layers * (
        attention + 3 * text.hidden_size * text.intermediate_size
    )
    assert qlora.weights < 0.5 * lora.weights
    assert qlora.total < lora.total < full.total


def test_sequence_parallelism_divides_the_activations_and_logits_by_its_size():
    name = "Qwen/Qwen2.5-7B-Instruct"
    ds = {"zero_optimization": {"stage": 3}}
    common = ["model.kind=llm", "data.max_seq_len=65536", "model.gradient_checkpointing=true"]
    whole = estimate(_cfg(name, *common), ds, gpus=8, gpu_memory_gb=80)
    sliced = estimate(_cfg(name, *common, "parallel.sequence_parallel_size=4"), ds, gpus=8, gpu_memory_gb=80)
    per_token, recompute = activation_bytes_per_token(hf_config_for(name), "bfloat16", checkpointing=True)
    assert sliced.activations == pytest.approx(65536 / 4 * (per_token + recompute))
    assert whole.activations == pytest.approx(4 * sliced.activations)
    assert sliced.logits_and_loss <= whole.logits_and_loss
    # ZeRO-3 still shards the model states over all 8 ranks (the data- and sequence-parallel ones)
    for part in ("weights", "gradients", "optimizer_states"):
        assert getattr(sliced, part) == getattr(whole, part), part


def test_lora_head_choices_count_what_they_train():
    """lora.head on Qwen3-VL-8B (V = 151936, H = 4096): full trains the V x H head and keeps peft's frozen
    copy of it; number_rows trains k x H (the ten digits, + '-' and '.' when NTIL reads them); frozen
    trains none of it."""
    name = "Qwen/Qwen3-VL-8B-Instruct"
    ds = {"zero_optimization": {"stage": 2}}

    def counts(*overrides):
        cfg = _cfg(name, "model.freeze_vision_tower=true", "lora.enabled=true", *overrides)
        return estimate(cfg, ds, gpus=1, gpu_memory_gb=24)

    full, frozen = counts("lora.head=full"), counts("lora.head=frozen")
    rows = counts("lora.head=number_rows")
    signed = counts("lora.head=number_rows", "loss.signed_numbers=true", "loss.decimal_numbers=true")
    vocab, hidden = 151936, 4096
    assert full.counts.trainable - frozen.counts.trainable == vocab * hidden == 622_329_856
    assert full.counts.total - frozen.counts.total == vocab * hidden  # the trained copy beside the original
    assert rows.counts.trainable - frozen.counts.trainable == 10 * hidden
    assert signed.counts.trainable - frozen.counts.trainable == 12 * hidden
    assert rows.counts.total - frozen.counts.total == 10 * hidden
    # ZeRO-2 on one GPU: 6 B of gradients and 12 B of optimizer states per trained parameter
    assert rows.gradients - frozen.gradients == pytest.approx(6 * 10 * hidden)
    assert rows.optimizer_states - frozen.optimizer_states == pytest.approx(12 * 10 * hidden)


def _saved_bytes_per_token(model, tokens, vocab):
    """Bytes of the tensors autograd keeps for backward during one forward (parameters excluded)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, vocab, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(v for k, v in seen.items() if k not in params) / tokens


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_formula_matches_what_a_real_model_saves(checkpointing):
    """Dimensions unlike the ones the constants were measured on; per-layer bytes from 1 vs 3 layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def measured(layers):
        config = Qwen2Config(
            vocab_size=300, hidden_size=96, intermediate_size=320, num_hidden_layers=layers,
            num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2ForCausalLM._from_config(
            config, attn_implementation="sdpa", dtype=torch.bfloat16
        ).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return _saved_bytes_per_token(model, 128, 300), config

    one, _ = measured(1)
    three, config = measured(3)
    per_layer = (three - one) / 2
    kept, _ = activation_bytes_per_token(config, "bfloat16", checkpointing)
    assert kept / 3 == pytest.approx(per_layer, rel=0.1)


@pytest.mark.parametrize(("experts", "top_k", "width"), [(16, 4, 40), (4, 1, 128)])
def test_moe_activation_formula_matches_what_a_real_moe_saves(experts, top_k, width):
    """A mixture of experts: the active experts' widths count, not the dense intermediate_size (320 here,
    unused by the sparse layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def measured(layers):
        config = Qwen3MoeConfig(
            vocab_size=300, hidden_size=96, intermediate_size=320, moe_intermediate_size=width,
            num_experts=experts, num_experts_per_tok=top_k, num_hidden_layers=layers, num_attention_heads=6,
            num_key_value_heads=3, head_dim=16, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
        return _saved_bytes_per_token(model.train(), 128, 300), config

    one, _ = measured(1)
    three, config = measured(3)
    kept, _ = activation_bytes_per_token(config, "bfloat16", False)
    assert kept / 3 == pytest.approx((three - one) / 2, rel=0.06)


def test_recipe_headers_state_the_estimators_numbers():
    """Every recipe for GPUs carries the tool's line for the GPUs it names, and that says it fits."""
    import json

    checked = 0
    for recipe in RECIPES:
        text = recipe.read_text()
        match = re.search(
            r"# launch/estimate\.py --gpus (\d+) --gpu-memory-gb (\d+): ([\d.]+) GiB of ([\d.]+) GiB per GPU \((\w+)\)",
            text,
        )
        if "GPUs:" not in text:
            continue
        assert match, f"{recipe.name}: no '# launch/estimate.py --gpus N --gpu-memory-gb G: ...' line"
        gpus, memory = int(match.group(1)), float(match.group(2))
        cfg = load_config(recipe)
        result = estimate(cfg, json.loads((REPO_ROOT / cfg.deepspeed).read_text()), gpus, memory)
        assert float(match.group(3)) == pytest.approx(result.total / GIB, abs=0.051), recipe.name
        assert float(match.group(4)) == pytest.approx(result.usable / GIB, abs=0.051), recipe.name
        assert match.group(5) == "fits" and result.fits, recipe.name
        checked += 1
    assert checked >= 6


def test_cli_prints_the_breakdown_and_exits_by_fit(capsys):
    from launch.estimate import main

    recipe = str(REPO_ROOT / "configs" / "train" / "qwen2vl_2b_clock.yaml")
    assert main([recipe, "--gpus", "4", "--gpu-memory-gb", "24"]) == 0
    out = capsys.readouterr().out
    for part in ("weights", "gradients", "optimizer states", "ZeRO-3 live parameters", "logits and loss",
                 "activations (checkpointing on)", "activations with checkpointing off", "fits"):  # fmt: skip
        assert part in out, part
    assert main([recipe, "--gpus", "1", "--gpu-memory-gb", "8", "train.micro_batch_size=4"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main([recipe, "--gpus", "1", "--gpu-memory-gb", "8", "model.name_or_path=org/unknown"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main([recipe, "--gpus", "1", "--gpu-memory-gb", "8", "model.kind=llm"]) == 2  # a Qwen2-VL
    assert "model.kind=llm contradicts the checkpoint" in capsys.readouterr().err


def test_local_folder_config_is_read(tiny):
    assert hf_config_for(str(tiny["gemma3"])).model_type == "gemma3"


def _sparse_layers(text) -> int:
    """MoE layers of a text config, by the family's own field (GLM: the first k layers are dense)."""
    return text.num_hidden_layers - getattr(text, "first_k_dense_replace", 0)


@pytest.mark.parametrize("kind", ["qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe"])
def test_moe_total_and_active_parameters_against_the_real_model(tmp_path, kind):
    """Total: the numel of the real tiny model's parameters. Active (a token's forward): the total less
    the routed experts it is not sent to, by hand from the config: per MoE layer E - k experts of
    gate_up (2 w x h) and down (h x w). The expert block: one layer's E experts, what ZeRO-3 gathers."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = build_tiny_model_folder(kind, tmp_path / kind)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_config(config)
    text = config.text_config
    experts = getattr(text, "num_experts", None) or text.n_routed_experts
    h, w, k = text.hidden_size, text.moe_intermediate_size, text.num_experts_per_tok
    per_expert = 3 * h * w
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    counts, _ = count_parameters(_cfg(folder))
    assert counts.total == total
    assert counts.active == total - _sparse_layers(text) * (experts - k) * per_expert
    assert counts.expert_block == experts * per_expert
    assert 0 < counts.active < counts.total


def test_llama4_total_and_active_parameters_against_its_text_model(tmp_path):
    """Llama 4 as it trains (its text model, model.kind=llm): total = the real tiny Llama4ForCausalLM's
    numel; active = less E - k routed experts per MoE layer (``num_local_experts``, width
    ``intermediate_size``; every layer sparse here, as in Scout)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = build_tiny_model_folder("llama4", tmp_path / "llama4")
    text = AutoConfig.from_pretrained(folder).text_config
    model = AutoModelForCausalLM.from_config(text)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    h, w, experts, k = (
        text.hidden_size,
        text.intermediate_size,
        text.num_local_experts,
        text.num_experts_per_tok,
    )
    counts, _ = count_parameters(_cfg(folder, "model.kind=llm"))
    assert counts.total == total
    assert counts.active == total - len(text.moe_layers) * (experts - k) * 3 * h * w
    assert counts.expert_block == experts * 3 * h * w


def test_dense_models_report_no_active_count(tiny):
    counts, _ = count_parameters(_cfg(tiny["qwen2_vl"]))
    assert (counts.active, counts.expert_block) == (0, 0)


def test_cli_reports_active_parameters_and_the_expert_block(capsys):
    from launch.estimate import main

    main(["configs/train/qwen3vl_30b_a3b_clock.yaml", "--gpus", "16", "--gpu-memory-gb", "80"])
    out = capsys.readouterr().out
    # 128 experts x 3 x 2048 x 768 in bf16 per layer; 48 layers x 120 idle experts left out per token
    assert "one layer's expert block: 604.0 M parameters, 1.12 GiB gathered" in out
    total = 31_070_754_032
    assert f"active per token {(total - 48 * 120 * 3 * 2048 * 768) / 1e9:.2f} B" in out


def test_teacher_forced_evaluation_peak_counts_every_positions_logits_of_the_slice():
    """Evaluation keeps no activations but reads the logits of every position (of each rank's slice under
    sequence parallelism): its peak is the model states and those logits with the loss's, and a recipe
    fits only if both its training step and its evaluation do."""
    import json

    recipe = REPO_ROOT / "configs" / "train" / "qwen25_7b_64k_sequence_parallel.yaml"
    ds_json = json.loads((REPO_ROOT / "configs" / "deepspeed" / "zero3.json").read_text())
    cfg = load_config(recipe)
    got = estimate(cfg, ds_json, 8, 40)
    slice_tokens = cfg.data.max_seq_len // cfg.parallel.sequence_parallel_size
    logits = slice_tokens * KNOWN_CONFIGS["Qwen/Qwen2.5-7B-Instruct"]["vocab_size"] * 2  # bf16
    assert got.evaluation_logits == pytest.approx(logits * (1 + NTIL_PEAK_OVER_LOGITS))
    assert got.evaluation_peak == pytest.approx(got.model_states() + got.evaluation_logits)
    assert "teacher-forced evaluation" in got.report()
    no_eval = load_config(recipe, ["data.eval_file=", "train.eval_every=0"])
    assert estimate(no_eval, ds_json, 8, 40).evaluation_logits == 0
    # a GPU with room for the training step but not for evaluation's logits does not fit
    tight = (got.total + got.evaluation_peak) / 2  # bytes usable between the two
    memory_gb = (tight / (1 - FRAGMENTATION) + CUDA_CONTEXT_GIB * GIB) / 1e9
    squeezed = estimate(cfg, ds_json, 8, memory_gb)
    assert squeezed.total <= squeezed.usable < squeezed.evaluation_peak and not squeezed.fits
