"""Which loaded models DeepSpeed's Ulysses sequence parallelism can wrap (``parallel.sequence_parallel_size``
> 1), checked before anything is registered; the registration itself is in ``ntil_ds.engine``.

Ulysses trades the sequence for the heads inside attention: an all-to-all gives each rank of the group
the whole sequence for ``heads / size`` heads, so the head counts must split; it replaces the attention
function transformers calls (sdpa, flash), so the model's attention must be one of those; and it only
wraps softmax attention, so layers that carry a state along the row (Gated DeltaNet) would see a slice
of it; it drops the attention mask, so a sliding window (which lives only in the mask on sdpa) would
silently become full attention. A row longer than the model's position window needs rope scaling.
The checks read the model's config alone: the trainer runs them at start, before any weight loads.

A multimodal model cannot take a slice of its rows: an image's patches may straddle the cut, and its
rotary positions (Qwen's 3-D mrope) count from the image's place in the whole row. So it takes whole
rows, merges the images into the text embeddings as on one process, and :func:`slice_after_merge` cuts
what it then hands its language model: the merged embeddings, the positions computed on whole rows,
Qwen3-VL's deepstack features. The Qwen and GLM families' vision tower runs each image once in the
group: every rank runs it on its share of the images and the features are all-gathered
(:func:`_tower_on_share`), so the tower's activations are divided over the group like the language
model's (the LLaVA-style towers still run on every rank on all the images). The merged embeddings' gradient
reaches each rank only through its own slice, and the gather's backward sums the group's gradients of
each image on the rank that ran it: the group's gradients add up to one process's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ntil_ds.config import ConfigError
from ntil_ds.model.parts import has_vision, num_experts, text_config_of

WRAPPABLE_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")

# Multimodal families whose model merges the images into the text embeddings and then calls its language
# model with keywords that slice_after_merge knows how to cut (each checked by
# tests/unit/test_sequence_parallel_multimodal.py: what the language model takes is the slice of the whole
# rows'; Qwen2-VL also end to end against one process, tests/distributed/test_sequence_parallel.py).
SLICED_AFTER_MERGE = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "glm4v",
    "llava",
    "mistral3",
    "internvl",
    "smolvlm",
)


def check_sequence_parallel_supported(
    config: Any, size: int, *, max_seq_len: int | None = None, attention: str | None = None
) -> None:
    """Raise ConfigError, naming the fix, when a model with ``config`` cannot train at this size. Run at
    start on the model's config alone (no weight loaded): ``attention`` is the implementation the model
    will be loaded with (default: the config's own), ``max_seq_len`` the rows' length (data.max_seq_len)."""
    text = text_config_of(config)
    name = getattr(config, "model_type", "this model")
    key = f"parallel.sequence_parallel_size={size}"
    if num_experts(config):
        raise ConfigError(
            f"{key} with {name!r}, a mixture of experts: DeepSpeed's ZeRO-3 does not run sequence "
            "parallelism with experts; set parallel.sequence_parallel_size=1"
        )
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        raise ConfigError(
            f"{key} with {name!r}: its linear-attention layers (Gated DeltaNet) carry state along the whole "
            "row, which Ulysses (it wraps softmax attention only) would cut at every slice; set "
            "parallel.sequence_parallel_size=1"
        )
    window = sliding_window_of(text)
    if window:
        raise ConfigError(
            f"{key} with {name!r}: its sliding-window attention layers (window {window}) keep the window "
            "only in the attention mask, which Ulysses' attention does not take: they would train with full "
            "attention; set parallel.sequence_parallel_size=1 (or use_sliding_window=false in the model's "
            "config.json where the model was trained without it)"
        )
    if has_vision(config) and name not in SLICED_AFTER_MERGE:
        why = (
            "its language model reads the images through cross-attention layers, whose keys are the image, "
            "not the sequence Ulysses splits"
            if getattr(text, "cross_attention_layers", None)
            else "its language model takes inputs that ntil-ds does not know how to slice"
        )
        raise ConfigError(
            f"{key} with {name!r}, a multimodal model: {why}. Sequence parallelism trains the multimodal "
            f"families {', '.join(SLICED_AFTER_MERGE)}; train this one with parallel.sequence_parallel_size=1"
        )
    positions = getattr(text, "max_position_embeddings", None)
    if max_seq_len and positions and max_seq_len > positions and not rope_scaled(text):
        factor = -(-max_seq_len // positions)
        raise ConfigError(
            f"data.max_seq_len={max_seq_len} with {name!r}, whose position window is {positions} tokens "
            "(max_position_embeddings) without rope scaling: positions past it were never trained. Add YaRN "
            f'to the model folder\'s config.json, "rope_scaling": {{"rope_type": "yarn", "factor": {factor}.0, '
            f'"original_max_position_embeddings": {positions}}}, and point model.name_or_path at that folder; '
            f"or set data.max_seq_len<={positions}"
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ConfigError(
            f"{key} with {name!r}: its {heads} attention heads and {kv_heads} key/value heads must split "
            f"over the {size} ranks (heads divisible by the size; key/value heads divisible by it or "
            "dividing it); choose a size that divides them"
        )
    attention = attention or getattr(config, "_attn_implementation", None)
    if attention not in WRAPPABLE_ATTENTION:
        raise ConfigError(
            f"{key} with attention {attention!r}: Ulysses wraps {', '.join(WRAPPABLE_ATTENTION)}; set "
            "model.attn_implementation=auto or sdpa"
        )


def sliding_window_of(text: Any) -> int | None:
    """The window of a text config's sliding-window layers (None: every layer attends to the whole row)."""
    layer_types = getattr(text, "layer_types", None) or ()
    if "sliding_attention" not in layer_types and not getattr(text, "use_sliding_window", False):
        return None
    return getattr(text, "sliding_window", None) or None


def rope_scaled(text: Any) -> bool:
    """Whether the rotary positions are scaled past the trained window (YaRN, linear, dynamic, ...):
    transformers 5's ``rope_parameters`` (one dict, or one per layer type), or an older ``rope_scaling``."""
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    per_layer = [v for v in rope.values() if isinstance(v, dict)] if isinstance(rope, dict) else []
    kinds = {(r.get("rope_type") or r.get("type") or "default") for r in (per_layer or [rope])}
    return bool(kinds - {"default"})


def check_sequence_parallel_at_start(cfg: Any, device: Any) -> None:
    """The recipe's model, by its config.json alone, against ``parallel.sequence_parallel_size`` (the
    trainer's first check, before the data and the weights load)."""
    from transformers import AutoConfig

    from ntil_ds.model.loading import resolve_attn_implementation

    config = AutoConfig.from_pretrained(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
    attention = resolve_attn_implementation(cfg.model.attn_implementation, device)
    check_sequence_parallel_supported(
        config, cfg.parallel.sequence_parallel_size, max_seq_len=cfg.data.max_seq_len, attention=attention
    )


@contextmanager
def slice_after_merge(
    model: torch.nn.Module, where: Any, group: Any = None, all_gather: Any = None
) -> Iterator[None]:
    """Within: the language model of multimodal ``model``, called on whole rows, takes this rank's slice
    ``where`` (a :class:`ntil_ds.dist.SequenceSlice`) of what the model built on them (the module
    docstring): the merged embeddings, the rotary positions, Qwen3-VL's deepstack features. No attention
    mask: Ulysses masks causally by the gathered positions, for which the row's text positions come first.
    With the sequence-parallel ``group`` and ``all_gather`` (a differentiable all-gather ``(local, group)
    -> pieces``: the loss's ``AllGatherInGroup.apply``), the vision tower runs on this rank's share of the
    images only, the group's features gathered (:func:`_tower_on_share`)."""
    handle = language_model_of(model).register_forward_pre_hook(partial(_take_slice, where), with_kwargs=True)
    tower = _patch_grid_tower(model)
    split = group is not None and tower is not None
    if split:
        tower.forward = partial(_tower_on_share, tower.forward, tower.spatial_merge_size, group, all_gather)
    try:
        yield
    finally:
        handle.remove()
        if split:
            del tower.forward  # the class's own again


def _patch_grid_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The Qwen and GLM families' vision tower (``visual``: all images' patches in, with their grids),
    which :func:`_tower_on_share` can split by image; None for the others (LLaVA-style towers run whole on
    every rank of the group)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "visual" and hasattr(module, "spatial_merge_size"):
            return module
    return None


def _tower_on_share(
    forward: Any, merge: int, group: Any, all_gather: Any, pixels: torch.Tensor, grid_thw: torch.Tensor, **kw
):
    """The vision tower's output for all the group's images, each image run on one rank: this rank runs
    ``forward`` (the tower's own) on its contiguous share (balanced by patches), and the merged features
    (and deepstack features) of every share are all-gathered, differentiably: each rank's backward then
    holds the whole loss's gradient for its own images. A rank with no image runs the first one and adds
    it times zero (ZeRO-3 needs every rank in every module's forward and backward)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    patches = grid_thw.prod(-1).tolist()
    total, before, owners = sum(patches), 0, []
    for count in patches:  # image i to the rank holding its middle patch of the whole: contiguous shares
        owners.append(min(size - 1, int((before + count / 2) * size / total)))
        before += count
    mine = [i for i, owner in enumerate(owners) if owner == rank] or [0]
    first, last = mine[0], mine[-1] + 1
    starts = [0, *torch.tensor(patches).cumsum(0).tolist()]
    out = forward(pixels[starts[first] : starts[last]], grid_thw=grid_thw[first:last], **kw)
    runs_none = rank not in owners
    counts = [sum(p // merge**2 for p, o in zip(patches, owners, strict=True) if o == r) for r in range(size)]

    def gathered(features: torch.Tensor) -> torch.Tensor:
        local = features[:0] if runs_none else features
        padded = local.new_zeros(max(counts), *local.shape[1:])
        padded = torch.cat([local, padded[local.shape[0] :]])
        pieces = all_gather(padded.contiguous(), group)
        joined = torch.cat([piece[:count] for piece, count in zip(pieces, counts, strict=True)])
        return joined + 0 * features.sum() if runs_none else joined

    fields = {"pooler_output": gathered(out.pooler_output)}
    if getattr(out, "deepstack_features", None) is not None:
        fields["deepstack_features"] = [gathered(f) for f in out.deepstack_features]
    return type(out)(**fields)


def route_attention(model: torch.nn.Module, key: str, whole_rows_attention: Any) -> None:
    """DeepSpeed's Ulysses replaces transformers' attention function ``key`` for every module in the
    process. Put back ``whole_rows_attention`` (the function it replaced) wherever the rows are whole: in a
    multimodal model's vision tower (it attends within whole images, on every rank), and in evaluation
    outside :func:`ulysses_in_evaluation` (generation runs whole rows). The language model in training,
    and in the teacher-forced evaluation of sliced rows, attends through Ulysses."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ulysses = ALL_ATTENTION_FUNCTIONS[key]
    sliced = language_model_of(model) if has_vision(model.config) else model
    language = {id(module) for module in sliced.modules()}

    def by_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        on_slices = id(module) in language and (module.training or _SlicedEvaluation.on)
        return (ulysses if on_slices else whole_rows_attention)(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[key] = by_module


class _SlicedEvaluation:
    on = False


@contextmanager
def ulysses_in_evaluation() -> Iterator[None]:
    """Within: a model in evaluation mode attends through Ulysses, for the teacher-forced evaluation of
    sliced rows (outside it, evaluation attends to whole rows: generation)."""
    _SlicedEvaluation.on = True
    try:
        yield
    finally:
        _SlicedEvaluation.on = False


def language_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """A multimodal model's language model (the outermost module so named, under adapters too)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("language_model", "text_model"):
            return module
    raise ValueError(f"{type(model).__name__} has no language_model or text_model to slice the rows for")


def _take_slice(where: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    embeds = kwargs.get("inputs_embeds")
    if args or embeds is None:
        raise RuntimeError(
            f"{type(module).__name__} was called without inputs_embeds as a keyword: this family does not "
            "merge images before its language model as sequence parallelism needs"
        )
    batch, length = embeds.shape[:2]
    text_positions = torch.arange(length, device=embeds.device).expand(batch, length)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = text_positions
    elif positions.ndim == 3 and positions.shape[0] == 3:  # (temporal, height, width): text positions first
        positions = torch.cat([text_positions[None], positions])
    sliced = dict(kwargs, inputs_embeds=where.part(embeds), attention_mask=None)
    if positions.ndim == 2:
        sliced["position_ids"] = where.part(positions)
    else:  # [4, B, T]: cut along T
        sliced["position_ids"] = where.part(positions.movedim(0, -1)).movedim(-1, 0)
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:  # Qwen3-VL's deepstack: features for the image positions, in row-major order
        order = visual.flatten().cumsum(0).reshape(visual.shape) - 1
        sliced["visual_pos_masks"] = where.part(visual)
        index = where.part(order)[sliced["visual_pos_masks"]]
        sliced["deepstack_visual_embeds"] = [e[index] for e in kwargs["deepstack_visual_embeds"]]
    for key, value in kwargs.items():  # anything else laid out by position would reach attention uncut
        if key not in _SLICED_KEYS and isinstance(value, torch.Tensor) and value.shape[:2] == (batch, length):
            raise RuntimeError(f"{type(module).__name__} takes {key} by position, which is not sliced")
    return (), sliced


_SLICED_KEYS = (
    "inputs_embeds",
    "attention_mask",
    "position_ids",
    "visual_pos_masks",
    "deepstack_visual_embeds",
)
