"""model.kernels=liger: Liger-Kernel's modules patched into the language model, on every kind the
project trains; a clear error without the package; the rotary kernel's numbers under Triton's interpreter.

What CPU can check: the patching itself (which modules, which forwards), and the rotary kernel on the
cos/sin a real tiny Qwen2-VL produces (M-RoPE, per-batch) in Triton's interpreter. Liger's RMSNorm and
SwiGLU kernels do not run in the interpreter (they call `.to` on Python scalar arguments, which only
compiled Triton turns into tensors); their numbers are left to the GPU (benchmarks/train_step.py --device
cuda runs the patched model).
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from ntil_ds.config import ConfigError
from ntil_ds.model.kernels import (
    ROTARY_MODULES,
    apply_kernels,
    check_kernels,
    language_model,
    require_kernels,
)
from ntil_ds.tiny import build_tiny_model_folder
from tests.conftest import REPO_ROOT

pytest.importorskip("liger_kernel")


@pytest.fixture(autouse=True)
def original_rotary(monkeypatch) -> dict[str, object]:
    """The rotary patch sets a module-level function for the whole process: every test here gets the
    originals back afterwards (so no other test runs on a patched transformers). Returns them by module."""
    originals = {}
    for name in set(ROTARY_MODULES.values()):
        module = importlib.import_module(name)
        originals[name] = module.apply_rotary_pos_emb
        monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)
    return originals


def _tiny_model(kind: str, root, **text_overrides):
    """A real tiny model of ``kind`` from ntil_ds/tiny's config (random weights); "llama" (no tiny folder:
    no recipe trains a bare Llama) from the same text sizes as the others."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, LlamaConfig

    if kind == "llama":
        config = LlamaConfig(
            **AutoConfig.from_pretrained(build_tiny_model_folder("qwen2", root / kind)).to_dict()
        )
        config.model_type = "llama"
    else:
        config = AutoConfig.from_pretrained(build_tiny_model_folder(kind, root / kind))
    for key, value in text_overrides.items():
        setattr(config.get_text_config(), key, value)
    auto = AutoModelForCausalLM if kind in ("qwen2", "llama") else AutoModelForImageTextToText
    torch.manual_seed(0)
    return auto.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "llava", "qwen2", "llama"])
def test_liger_patches_norms_mlps_and_rotary(kind, tmp_path):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    model = _tiny_model(kind, tmp_path)
    assert model.config.model_type == kind
    # The function the model's own attention calls: a global name looked up when its forward runs, in the
    # module that defines the forward (found from the model, not from the code's ROTARY_MODULES map).
    attention_forward = inspect.unwrap(type(language_model(model).layers[0].self_attn).forward)
    assert "apply_rotary_pos_emb" in attention_forward.__code__.co_names
    attention_globals = attention_forward.__globals__
    lm = language_model(model)
    norms = [m for m in lm.modules() if type(m).__name__.endswith("RMSNorm")]
    mlps = [m for m in lm.modules() if type(m).__name__.endswith("MLP")]
    before = {name: p.clone() for name, p in model.named_parameters()}

    counts = apply_kernels(model, "liger")

    layers = model.config.get_text_config().num_hidden_layers
    assert counts == {"rms_norm": 2 * layers + 1, "swiglu_mlp": layers, "rotary": layers}
    assert len(norms) == 2 * layers + 1 and len(mlps) == layers
    for norm in norms:
        assert norm.forward.__func__ is LigerRMSNorm.forward and norm._get_name() == "LigerRMSNorm"
    for mlp in mlps:
        assert mlp.forward.__func__ is LigerSwiGLUMLP.forward
    assert attention_globals["apply_rotary_pos_emb"] is liger_rotary_pos_emb
    # nothing outside the language model, and no parameter, is touched
    outside = [
        m for n, m in model.named_modules() if m._get_name().startswith("Liger") and "language_model" not in n
    ]
    assert kind in ("qwen2", "llama") or not outside
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_rotary_patch_is_restored_after_each_test():
    """The autouse fixture gave the previous tests' patched modules their own function back."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    for name in set(ROTARY_MODULES.values()):
        assert importlib.import_module(name).apply_rotary_pos_emb is not liger_rotary_pos_emb, name


def _undo(model, patch: str, original_rotary) -> None:
    """Take one part of Liger's patch back off a patched model (what a transformers version on which
    that part finds nothing leaves): one norm's forward, every MLP's forward, or the rotary function."""
    lm = language_model(model)
    if patch == "rms_norm":
        norm = next(m for m in lm.modules() if type(m).__name__.endswith("RMSNorm"))
        del norm.__dict__["forward"]  # Liger binds its forward on the instance: the class's is back
    elif patch == "swiglu_mlp":
        for mlp in (m for m in lm.modules() if type(m).__name__.endswith("MLP")):
            del mlp.__dict__["forward"]
    else:
        name = ROTARY_MODULES[model.config.model_type]
        importlib.import_module(name).apply_rotary_pos_emb = original_rotary[name]


@pytest.mark.parametrize(
    ("patch", "found"), [("rms_norm", "4 modules"), ("swiglu_mlp", "0 modules"), ("rotary", "0 modules")]
)
def test_a_patch_that_did_not_take_is_a_config_error_naming_it(patch, found, tmp_path, original_rotary):
    """check_kernels on a real patched Qwen2-VL with one part of the patch undone: the error names that
    patch, what it reached against the config's count (2 layers: 5 norms, 2 MLPs, 2 attentions), the
    family, the transformers version and the fix."""
    import transformers

    model = _tiny_model("qwen2_vl", tmp_path)
    apply_kernels(model, "liger")
    check_kernels(model)  # the complete patch passes
    _undo(model, patch, original_rotary)
    expected = {"rms_norm": 5, "swiglu_mlp": 2, "rotary": 2}[patch]
    with pytest.raises(ConfigError) as error:
        check_kernels(model)
    message = str(error.value)
    assert f"the {patch} patch reaches {found} of the qwen2_vl language model" in message
    assert f"its config implies {expected}, on transformers {transformers.__version__}" in message
    assert message.endswith("set model.kernels=none")
    if patch == "rotary":
        assert "reads it from transformers.models.qwen2_vl.modeling_qwen2_vl.apply_rotary_pos_emb" in message


def test_llava_on_a_qwen2_language_model_is_refused_for_its_rotary(tmp_path):
    """A real case the map does not cover: LLaVA (model_type llava) with a Qwen2 language model, as
    LLaVA-Interleave ships. Its norms and MLPs take the patch, but the rotary one is set in Llama's module
    while Qwen2's attention reads Qwen2's: before the check that trained silently without the kernel."""
    from transformers import AutoConfig, LlavaForConditionalGeneration, Qwen2Config

    config = AutoConfig.from_pretrained(build_tiny_model_folder("llava", tmp_path / "llava"))
    text = config.text_config.to_dict()
    text["model_type"] = "qwen2"
    config.text_config = Qwen2Config(**text)
    model = LlavaForConditionalGeneration(config)
    assert type(language_model(model)).__name__ == "Qwen2Model"
    with pytest.raises(ConfigError) as error:
        apply_kernels(model, "liger")
    message = str(error.value)
    assert "the rotary patch reaches 0 modules of the llava language model (qwen2)" in message
    assert "reads it from transformers.models.qwen2.modeling_qwen2.apply_rotary_pos_emb" in message
    assert "set it in transformers.models.llama.modeling_llama" in message


def test_renamed_norm_class_is_refused(tmp_path):
    """A transformers version that names the final norm's class differently (not ...RMSNorm): the patch
    finds 4 of the 5 norms, and the run stops at start instead of training with one unfused norm."""
    model = _tiny_model("qwen2", tmp_path)
    final = language_model(model).norm
    final.__class__ = type("Qwen2FinalNorm", (type(final),), {})  # same module, another class name
    with pytest.raises(ConfigError, match=r"the rms_norm patch reaches 4 modules .* implies 5"):
        apply_kernels(model, "liger")


def test_gelu_mlp_is_left_alone_and_passes(tmp_path):
    """hidden_act gelu: the MLP is no SwiGLU, so none is patched and the config expects none."""
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    model = _tiny_model("qwen2", tmp_path, hidden_act="gelu")
    counts = apply_kernels(model, "liger")
    assert counts == {"rms_norm": 5, "swiglu_mlp": 0, "rotary": 2}
    assert all(layer.mlp.forward.__func__ is not LigerSwiGLUMLP.forward for layer in model.model.layers)


def test_without_liger_kernel_installed_is_a_clear_error(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a),
    )
    with pytest.raises(
        ConfigError, match=r"model.kernels=liger needs the liger-kernel package.*model.kernels=none"
    ):
        require_kernels("liger")
    require_kernels("none")  # the default needs nothing


def test_unsupported_model_type_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    with pytest.raises(ConfigError, match="set model.kernels=none"):
        apply_kernels(model, "liger")


@pytest.mark.timeout(600)
def test_liger_rotary_equals_transformers_on_qwen2_vl_mrope_in_triton_interpreter(tmp_path):
    """The patched rotary function on the M-RoPE cos/sin of a tiny Qwen2-VL (3-D positions, one
    row of them per sample) equals transformers' own, and so do the gradients. A subprocess: the
    interpreter must be switched on before Triton is imported."""
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from ntil_ds.tiny import build_tiny_model_folder

        folder = build_tiny_model_folder("qwen2_vl", {str(tmp_path / "q")!r})
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
        text = model.model.language_model
        positions = torch.stack([torch.arange(9), torch.arange(9) // 3, torch.arange(9) % 3])
        positions = torch.stack([positions, positions + 5], dim=1)  # [3, B=2, T=9], different per sample
        x = torch.randn(2, 9, model.config.text_config.hidden_size)
        cos, sin = text.rotary_emb(x, positions)
        heads, kv, dim = 4, 2, cos.shape[-1]
        results = []
        for fn in (m.apply_rotary_pos_emb, liger_rotary_pos_emb):
            torch.manual_seed(1)
            q = torch.randn(2, heads, 9, dim, requires_grad=True)
            k = torch.randn(2, kv, 9, dim, requires_grad=True)
            qo, ko = fn(q, k, cos, sin)
            (qo.square().sum() + ko.sum()).backward()
            results.append((qo.detach(), ko.detach(), q.grad, k.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        print("ROPE_OK", float((results[0][0] - results[1][0]).abs().max()))
        """
    )
    env = {
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(REPO_ROOT),
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=540
    )
    assert "ROPE_OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
