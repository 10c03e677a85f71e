"""One mixture-of-experts layer's forward + backward under each of transformers 5.24's experts
implementations (ntil_ds/model/experts.py), as a ratio to the per-expert loop (``eager``), in one run.

    python -m benchmarks.moe_speed                  # CPU, float32
    python -m benchmarks.moe_speed --device cuda    # bf16, Qwen3-VL-30B-A3B's layer shape

The layer is transformers' own ``Qwen3VLMoeTextSparseMoeBlock`` (router + fused experts), the same
weights for every implementation; the experts' dispatch is switched through
``config._experts_implementation`` as a loaded model's is. Shapes: CPU a reduced layer (hidden 512, 32
experts of 256, top-4, 2,048 tokens); CUDA Qwen3-VL-30B-A3B's (hidden 2048, 128 experts of 768, top-8,
8,192 tokens). Per implementation the median of ``--repeats`` timed forward+backward after a warm-up,
the implementations interleaved, and the max |difference| of output and gradients against eager.
Prints one JSON line per implementation and a table; ``auto``'s choice per device is written in
ntil_ds/model/experts.py from this table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ntil_ds.model.experts import EXPERTS_IMPLEMENTATIONS, resolve_experts_implementation

SHAPES = {  # hidden, experts, expert intermediate, top-k, tokens
    "cpu": (512, 32, 256, 4, 2048),
    "cuda": (2048, 128, 768, 8, 8192),
}


def build_layer(device: str, dtype: torch.dtype, shape=None):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    hidden, experts, inter, top_k, _ = shape or SHAPES[device]
    config = Qwen3VLMoeTextConfig(
        hidden_size=hidden, num_experts=experts, moe_intermediate_size=inter, num_experts_per_tok=top_k
    )
    torch.manual_seed(0)
    layer = Qwen3VLMoeTextSparseMoeBlock(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    return layer.to(device=device, dtype=dtype), config


def step(layer, config, impl: str, x: torch.Tensor, grad: torch.Tensor):
    config._experts_implementation = impl
    layer.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_(True)
    out = layer(xi)
    out.backward(grad)
    return out.detach(), xi.grad, [p.grad for p in layer.parameters()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--impls", default=",".join(EXPERTS_IMPLEMENTATIONS), help="comma-separated; eager is always run"
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    layer, config = build_layer(args.device, dtype)
    hidden, _, _, _, tokens = SHAPES[args.device]
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=gen).to(args.device, dtype)
    grad = torch.randn(1, tokens, hidden, generator=gen).to(args.device, dtype)
    impls = ["eager", *[i for i in args.impls.split(",") if i and i != "eager"]]
    reference = step(layer, config, "eager", x, grad)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    diffs: dict[str, float] = {}
    for impl in impls:  # warm-up, and the differences against eager
        got = step(layer, config, impl, x, grad)
        pairs = [(got[0], reference[0]), (got[1], reference[1]), *zip(got[2], reference[2], strict=True)]
        diffs[impl] = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    for _ in range(args.repeats):
        for impl in impls:
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(layer, config, impl, x, grad)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[impl].append(time.perf_counter() - start)
    auto = resolve_experts_implementation("auto", torch.device(args.device))
    eager = statistics.median(times["eager"])
    print(
        f"shape (hidden, experts, intermediate, top_k, tokens) = {SHAPES[args.device]}, {dtype}; auto = {auto}"
    )
    print("| implementation | forward+backward | / eager | max abs diff vs eager |")
    print("|---|---|---|---|")
    for impl in impls:
        median = statistics.median(times[impl])
        row = {
            "impl": impl,
            "device": args.device,
            "seconds": median,
            "ratio": median / eager,
            "diff": diffs[impl],
        }
        print(json.dumps(row))
        mark = " (auto)" if impl == auto else ""
        print(f"| {impl}{mark} | {median * 1e3:.1f} ms | {median / eager:.2f} | {diffs[impl]:.1e} |")


if __name__ == "__main__":
    main()
