"""Attention on packed rows: torch's flex_attention (a BlockMask of the documents) against sdpa with the
dense block-diagonal mask, both exactly as transformers 5.24 runs them for a packed micro-batch.

    python -m benchmarks.attention_speed                 # CPU: forward only, rows of 1k / 2k tokens
    python -m benchmarks.attention_speed --device cuda   # bf16 forward + backward, rows of 4k / 16k

The masks come from ``transformers.masking_utils.create_causal_mask`` on packed ``position_ids`` (restarting
at 0 per document, as `ntil_ds.data.packing.PackedCollator` lays them out), the attention from
transformers' ``sdpa_attention_forward`` / ``flex_attention_forward`` (which compiles flex_attention), at
Qwen2-VL-2B's attention shape: 12 query heads, 2 kv heads, head_dim 128. Documents of 16-600 tokens
(drawn with a fixed seed) fill each row.

Per case: the mask's build time (once per forward for all layers), the time of one attention forward
(+ backward on CUDA; torch 2.13's FlexAttention has no backward on CPU) per layer, median of
``--repeats`` after a warm-up that compiles, the two interleaved; the peak extra memory (CUDA: the
allocator's peak above what was allocated before; not on CPU: a dispatch mode cannot run the compiled
flex_attention) and the bytes of each mask (the dense [B, 1, T, T] one against the BlockMask); the max |difference| of the output (and on CUDA of the
gradients of q, k, v) against a float64 reference that runs each document's attention alone. Ratios are
flex / sdpa, from the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from torch import nn

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128  # Qwen2-VL-2B
CPU_ROWS = ((1, 1024), (1, 2048))  # (rows, tokens a row)
CUDA_ROWS = ((4, 4096), (1, 16384))


def document_lengths(tokens: int, rng: random.Random) -> list[int]:
    """Documents of 16-600 tokens filling a row exactly (the last one cut to fit)."""
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(16, 600), tokens - sum(lengths)))
    return lengths


def packed_positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


class Attention(nn.Module):
    """What transformers' attention functions read from the layer."""

    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS


def attention(impl: str, layer: Attention, q, k, v, mask) -> torch.Tensor:
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    forward = flex_attention_forward if impl == "flex_attention" else sdpa_attention_forward
    return forward(layer, q, k, v, mask, scaling=HEAD_DIM**-0.5, dropout=0.0)[0]  # [B, T, H, D]


def build_mask(impl: str, positions: torch.Tensor, dtype: torch.dtype):
    from transformers import Qwen2Config
    from transformers.masking_utils import create_causal_mask

    config = Qwen2Config(
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, hidden_size=HEADS * HEAD_DIM
    )
    config._attn_implementation = impl
    embeds = torch.empty(*positions.shape, 1, dtype=dtype, device=positions.device)
    return create_causal_mask(config, embeds, attention_mask=None, cache=None, position_ids=positions)


def reference(q, k, v, rows: list[list[int]]) -> torch.Tensor:
    """Each document's causal attention alone, in float64: [B, T, H, D]."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = torch.zeros_like(q)
    for r, row in enumerate(rows):
        start = 0
        for n in row:
            doc = slice(start, start + n)
            scores = q[r, :, doc] @ k[r, :, doc].transpose(-1, -2) * HEAD_DIM**-0.5
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            out[r, :, doc] = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[r, :, doc]
            start += n
    return out.transpose(1, 2)


def run_once(impl, layer, inputs, mask, grad_out, backward: bool) -> torch.Tensor:
    for t in inputs:
        t.grad = None
    if not backward:
        with torch.no_grad():
            return attention(impl, layer, *inputs, mask)
    out = attention(impl, layer, *inputs, mask)
    out.backward(grad_out)
    return out.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_extra_bytes(device, *args) -> int | None:
    """CUDA: the allocator's peak above what was allocated before. CPU: None (a dispatch mode, as the
    other benchmarks count CPU memory, cannot run the compiled flex_attention; the masks' own bytes are
    reported instead)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_once(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def mask_bytes(mask) -> int:
    """The dense mask's bytes, or the BlockMask's: its block counts and indices."""
    if isinstance(mask, torch.Tensor):
        return mask.nbytes
    return sum(t.nbytes for t in mask.as_tuple(flatten=True) if isinstance(t, torch.Tensor))


def measure(num_rows: int, tokens: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    rng = random.Random(tokens)
    rows = [document_lengths(tokens, rng) for _ in range(num_rows)]
    positions = packed_positions(rows).to(device)
    generator = torch.Generator().manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:  # [B, H, T, D] views of [B, T, H, D], as the model passes them
        t = torch.randn(num_rows, tokens, heads, HEAD_DIM, generator=generator).to(device, dtype)
        return t.transpose(1, 2).requires_grad_(backward)

    backward = device.type == "cuda"
    inputs = (tensor(HEADS), tensor(KV_HEADS), tensor(KV_HEADS))
    grad_out = torch.randn(num_rows, tokens, HEADS, HEAD_DIM, generator=generator).to(device, dtype)
    layer = Attention().train(backward)
    impls = ("sdpa", "flex_attention")
    masks, mask_s = {}, {}
    for impl in impls:
        build_mask(impl, positions, dtype)  # warm-up: flex compiles create_block_mask
        sync(device)
        started = time.perf_counter()
        masks[impl] = build_mask(impl, positions, dtype)
        sync(device)
        mask_s[impl] = time.perf_counter() - started

    leaves = [t.detach().requires_grad_(backward) for t in inputs]
    # The reference's own float64 leaves, so its gradients are not rounded back to the inputs' dtype.
    reference_leaves = [t.detach().double().requires_grad_(backward) for t in inputs]
    expected = reference(*reference_leaves, rows)
    if backward:
        expected.backward(grad_out.double())
    expected_grads = [t.grad for t in reference_leaves] if backward else []
    error, grad_error, times, memory = {}, {}, {impl: [] for impl in impls}, {}
    for impl in impls:
        out = run_once(impl, layer, leaves, masks[impl], grad_out, backward)  # warm-up: compiles flex
        error[impl] = (out.double() - expected).abs().max().item()
        grads = zip(leaves, expected_grads, strict=True)
        grad_error[impl] = (
            max((t.grad.double() - g).abs().max().item() for t, g in grads) if backward else None
        )
    for _ in range(repeats):
        for impl in impls:
            sync(device)
            started = time.perf_counter()
            run_once(impl, layer, leaves, masks[impl], grad_out, backward)
            sync(device)
            times[impl].append(time.perf_counter() - started)
    for impl in impls:
        memory[impl] = peak_extra_bytes(device, impl, layer, leaves, masks[impl], grad_out, backward)
    seconds = {impl: statistics.median(times[impl]) for impl in impls}
    return {
        "rows": num_rows,
        "tokens": tokens,
        "documents": sum(len(r) for r in rows),
        "dtype": str(dtype).removeprefix("torch."),
        "pass": "fwd+bwd" if backward else "fwd",
        **{f"{impl}_mask_s": mask_s[impl] for impl in impls},
        **{f"{impl}_s": seconds[impl] for impl in impls},
        **{f"{impl}_mib": None if memory[impl] is None else memory[impl] / 2**20 for impl in impls},
        **{f"{impl}_mask_mib": mask_bytes(masks[impl]) / 2**20 for impl in impls},
        **{f"{impl}_max_diff": error[impl] for impl in impls},
        **{f"{impl}_grad_max_diff": grad_error[impl] for impl in impls},
        "time_ratio": seconds["flex_attention"] / seconds["sdpa"],
        "memory_ratio": None if memory["sdpa"] is None else memory["flex_attention"] / memory["sdpa"],
    }


def memory_columns(r: dict) -> str:
    if r["memory_ratio"] is None:
        return f"{'n/a on CPU':>19} {'':>6}"
    return f"{r['sdpa_mib']:>9.1f}/{r['flex_attention_mib']:<9.1f} {r['memory_ratio']:>6.2f}"


def grad_diffs(r: dict) -> str:
    if r["sdpa_grad_max_diff"] is None:
        return f"{'n/a (no CPU backward)':>21}"
    return f"{r['sdpa_grad_max_diff']:>10.2e}/{r['flex_attention_grad_max_diff']:<10.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []
    print(
        f"{'rows':>4} {'T':>6} {'docs':>4} {'dtype':>8} {'pass':>7} | {'sdpa s':>8} {'flex s':>8} {'time x':>6} | "
        f"{'peak MiB sdpa/flex':>19} {'mem x':>6} | {'mask MiB sdpa/flex':>19} | {'mask s sdpa/flex':>17} | "
        f"{'max|d| sdpa/flex':>19} | {'grad max|d| sdpa/flex':>21}"
    )
    for num_rows, tokens in CUDA_ROWS if device.type == "cuda" else CPU_ROWS:
        r = measure(num_rows, tokens, device, dtype, args.repeats)
        results.append(r)
        print(
            f"{r['rows']:>4} {r['tokens']:>6} {r['documents']:>4} {r['dtype']:>8} {r['pass']:>7} | "
            f"{r['sdpa_s']:>8.4f} {r['flex_attention_s']:>8.4f} {r['time_ratio']:>6.2f} | "
            f"{memory_columns(r)} | {r['sdpa_mask_mib']:>9.2f}/{r['flex_attention_mask_mib']:<9.3f} | "
            f"{r['sdpa_mask_s']:>8.4f}/{r['flex_attention_mask_s']:<8.4f} | "
            f"{r['sdpa_max_diff']:>9.2e}/{r['flex_attention_max_diff']:<9.2e} | " + grad_diffs(r),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
