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
from ntil_ds.model.kernels import ROTARY_MODULES, apply_kernels, language_model, require_kernels
from ntil_ds.tiny import build_tiny_model_folder
from tests.conftest import REPO_ROOT

pytest.importorskip("liger_kernel")


def _tiny_model(kind: str, root):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    folder = build_tiny_model_folder(kind, root / kind)
    auto = AutoModelForCausalLM if kind == "qwen2" else AutoModelForImageTextToText
    torch.manual_seed(0)
    return auto.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "llava", "qwen2"])
def test_liger_patches_norms_mlps_and_rotary(kind, tmp_path, monkeypatch):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    model = _tiny_model(kind, tmp_path)
    # The function the model's own attention calls: a global name looked up when its forward runs, in the
    # module that defines the forward (found from the model, not from the code's ROTARY_MODULES map).
    attention_forward = inspect.unwrap(type(language_model(model).layers[0].self_attn).forward)
    assert "apply_rotary_pos_emb" in attention_forward.__code__.co_names
    attention_globals = attention_forward.__globals__
    # the rotary patch is process-wide: put the originals back after the test (also in the module the
    # map names, should that be another one)
    mapped = ROTARY_MODULES[model.config.model_type]
    for module in {importlib.import_module(name) for name in (attention_globals["__name__"], mapped)}:
        monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)
    lm = language_model(model)
    norms = [m for m in lm.modules() if type(m).__name__.endswith("RMSNorm")]
    mlps = [m for m in lm.modules() if type(m).__name__.endswith("MLP")]
    before = {name: p.clone() for name, p in model.named_parameters()}

    counts = apply_kernels(model, "liger")

    layers = model.config.get_text_config().num_hidden_layers
    assert counts == {"rms_norm": 2 * layers + 1, "swiglu_mlp": layers, "rotary": 1}
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
    assert kind == "qwen2" or not outside
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


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
