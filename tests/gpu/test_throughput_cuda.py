"""On CUDA: Liger's patched tiny models give the unpatched logits and gradients, and packing stays exact
with the attention kernels of a GPU (sdpa's CUDA backends, flash-attention 2 when installed).

CPU checks the patching (tests/unit/test_kernels.py) and packing with sdpa on CPU (test_packing.py); Liger's
RMSNorm and SwiGLU kernels only run compiled. Skipped without CUDA. `pytest -q tests/gpu`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest
import torch

# What this file's imports need beyond torch: a machine without one skips the file with the reason
# instead of a collection error (gpu_check.sh runs this file in its own pytest call all the same);
# hence the imports after it.
for _module in ("transformers", "PIL", "psutil", "yaml"):
    pytest.importorskip(
        _module, reason=f"{_module} does not import: tests/gpu/test_throughput_cuda.py needs it"
    )

from ntil_ds.data import Collator, ConversationDataset, load_processor, tokenizer_of  # noqa: E402
from ntil_ds.data.packing import PACKING_KEYS, PackedCollator  # noqa: E402
from ntil_ds.loss import NTILLoss, digit_token_ids_from_tokenizer  # noqa: E402
from ntil_ds.model.kernels import ROTARY_MODULES, apply_kernels, language_model  # noqa: E402
from ntil_ds.model.packing import rope_fn_for  # noqa: E402
from ntil_ds.tiny import build_tiny_model_folder  # noqa: E402
from tests.distributed.training_runs import write_mixed_arithmetic_data  # noqa: E402

pytestmark = pytest.mark.gpu


def _model(kind, folder, attn="sdpa", dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForCausalLM if kind == "qwen2" else AutoModelForImageTextToText
    torch.manual_seed(0)
    return auto.from_config(AutoConfig.from_pretrained(folder), dtype=dtype, attn_implementation=attn).cuda()


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "llava", "qwen2"])
def test_liger_patched_model_equals_unpatched(kind, tmp_path, monkeypatch):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    model = _model(kind, build_tiny_model_folder(kind, tmp_path / kind))
    # what the model's attention calls (not the code's own map): restored after, and checked patched below
    attention = inspect.unwrap(type(language_model(model).layers[0].self_attn).forward).__globals__
    mapped = ROTARY_MODULES[model.config.model_type]
    for rotary in {importlib.import_module(name) for name in (attention["__name__"], mapped)}:
        monkeypatch.setattr(rotary, "apply_rotary_pos_emb", rotary.apply_rotary_pos_emb)
    ids = torch.randint(0, 400, (2, 33), device="cuda")

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = run()
    apply_kernels(model, "liger")
    assert attention["apply_rotary_pos_emb"] is liger_rotary_pos_emb  # the patch reaches the forward
    logits, grads = run()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).abs().max() <= 1e-3 * grad.abs().max() + 1e-6, name


ATTENTION = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("kind", ["qwen2_vl", "llava"])
def test_packed_equals_unpacked_on_cuda(kind, attn, tmp_path):
    folder = build_tiny_model_folder(kind, tmp_path / kind)
    processor = load_processor(folder)
    dataset = ConversationDataset(write_mixed_arithmetic_data(tmp_path / "data", 8, 56), processor, 256)
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    model = _model(kind, folder, attn, dtype)
    samples = [dataset[i] for i in range(5)]
    row_tokens = None if attn == "flash_attention_2" else 100
    loss_fn = NTILLoss(digit_token_ids_from_tokenizer(tokenizer_of(processor)), gumbel_noise_scale=0.0)

    def run(batch, packed):
        inputs = {
            k: v.cuda().to(dtype) if v.is_floating_point() else v.cuda()
            for k, v in batch.items()
            if k not in ("targets", *PACKING_KEYS) and not (packed and k == "attention_mask")
        }
        logits = model(**inputs, use_cache=False).logits
        index = batch["unpack_index"].cuda() if packed else None
        return logits.float(), loss_fn(logits, batch["targets"].cuda(), unpack_index=index)

    logits_u, out_u = run(Collator(processor)(samples), packed=False)
    packed = PackedCollator(processor, rope_fn=rope_fn_for(model), row_tokens=row_tokens)(samples)
    logits_p, out_p = run(packed, packed=True)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    flat = logits_p.flatten(0, 1)
    for row, (sample, index) in enumerate(zip(samples, packed["unpack_index"], strict=True)):
        n = len(sample["input_ids"])
        torch.testing.assert_close(flat[index[:n].cuda()], logits_u[row, :n], **tol)
    torch.testing.assert_close(out_p.loss.float(), out_u.loss.float(), **tol)
