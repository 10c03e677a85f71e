"""Load a model folder's processor (or tokenizer, for a text-only LLM) the way the data pipeline needs it.

Why not plain `AutoProcessor.from_pretrained`: in transformers 5.24 the Qwen-VL processors require a video
processor, and every video processor requires torchvision. CPU machines with torch 2.13.0+cpu have no
matching torchvision (PyPI's build fails to import: "operator torchvision::nms does not exist"), yet
images need only the PIL image processor. So where torchvision is missing, a processor class that has a
video slot is built without it; images and text behave exactly as in the stock class. A family whose
image processor exists only as a torchvision backend (Llama 4) gets its tokenizer there, for text-only
data: a sample with an image is refused before the first step, saying why and how to get torchvision.
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
from pathlib import Path

# transformers is imported inside the functions: `launch/make_data.py` imports this package and needs
# none of it (the import costs seconds).


def load_processor(model_dir: str | Path):
    """Return the folder's multimodal processor, or its tokenizer when it has no processor (text-only LLM).

    Equal to `AutoProcessor.from_pretrained(model_dir)` wherever that works; see the module docstring for
    the one case where it does not (Qwen-VL processors without torchvision).
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    model_dir = Path(model_dir)
    processor_class = _declared_processor_class(model_dir)
    needs_video_processor = (
        processor_class is not None and "video_processor" in processor_class.get_attributes()
    )
    if needs_video_processor and not is_torchvision_available():
        processor = _image_only_class(processor_class)(
            image_processor=AutoImageProcessor.from_pretrained(model_dir),
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
            chat_template=_folder_chat_template(model_dir),
            **_processor_settings(model_dir, processor_class),
        )
        processor.source_dir = model_dir  # (not saved: only __init__ arguments are)
    elif processor_class is not None and not is_torchvision_available() and _torchvision_only(model_dir):
        # (Llama 4: its image processor is a torchvision backend only) the text-only processor: the
        # tokenizer, which says why images are refused (encoding.encode reads it before any step)
        processor = AutoTokenizer.from_pretrained(model_dir)
        processor.images_refused_because = (
            f"{model_dir}'s image processor ({_torchvision_only(model_dir)}) exists in transformers only as a "
            "torchvision backend and torchvision is not installed, so its images cannot be processed here; "
            "train text-only samples, or use the CUDA container (docker/), or install the torchvision build "
            f"that matches torch (pip install torchvision, for torch {_torch_version()})"
        )
    elif processor_class is not None and processor_class.__name__ in _PIL_STAND_INS:
        processor = processor_class.from_pretrained(model_dir)  # (AutoProcessor gives the placeholder)
    else:
        processor = AutoProcessor.from_pretrained(model_dir)
    fix_mistral_regex(tokenizer_of(processor), model_dir)
    return processor


def _torchvision_only(model_dir: Path) -> str | None:
    """The folder's image processor class when transformers has it only as a torchvision backend (no
    PIL one), else None."""
    from transformers.models.auto.auto_mappings import IMAGE_PROCESSOR_MAPPING_NAMES

    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    backends = IMAGE_PROCESSOR_MAPPING_NAMES.get(json.loads(config_file.read_text()).get("model_type"))
    if not isinstance(backends, dict) or "pil" in backends:
        return None
    return backends.get("torchvision")


def _torch_version() -> str:
    import torch

    return torch.__version__


# The model types whose tokenizer.json may carry the LLaMA-3 digit-grouping regex although the model was
# trained with one digit per token (the list transformers checks for its fix_mistral_regex).
MISTRAL_REGEX_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


def fix_mistral_regex(tokenizer, model_dir: str | Path) -> bool:
    """Give a Mistral-family tokenizer whose tokenizer.json groups digits (the LLaMA-3 regex: Mistral Small
    3.1 / Pixtral ship it by mistake) the one-digit-per-token split its model was trained with, as
    ``AutoTokenizer.from_pretrained(..., fix_mistral_regex=True)`` does (transformers' own patch, applied
    here whatever the vocabulary size: transformers only looks at tokenizers of more than 100,000 tokens,
    and only when asked). Logs what it did; True when it changed the tokenizer."""
    import logging

    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    if model_type not in MISTRAL_REGEX_TYPES or getattr(tokenizer, "fix_mistral_regex", None) is True:
        return False
    if not _groups_digits(tokenizer):
        return False
    tokenizer.fix_mistral_regex = False  # transformers' patch applies only to a tokenizer so flagged...
    tokenizer._tokenizer = type(tokenizer)._patch_mistral_regex(
        tokenizer._tokenizer, str(model_dir), is_local=True, fix_mistral_regex=True
    )
    if _groups_digits(tokenizer):
        raise ValueError(
            f"the tokenizer of {model_dir} (model_type {model_type!r}) groups digits and transformers' "
            "fix_mistral_regex did not make it write one digit per token; check its tokenizer.json"
        )
    tokenizer.fix_mistral_regex = True  # ...and records that it is fixed (saved with the tokenizer)
    logging.getLogger(__name__).warning(
        "%s: model_type %r, but its tokenizer.json carries the LLaMA-3 digit-grouping regex; loaded with "
        "fix_mistral_regex=True, so numbers are one digit per token, as the model was trained",
        model_dir,
        model_type,
    )
    return True


def _groups_digits(tokenizer) -> bool:
    """True when a token of "90123456789" spells more than one digit (the full probe, which says how, is
    ntil_ds/loss/tokenizer.py's; data/ stays below loss/)."""
    ids = tokenizer("x=90123456789", add_special_tokens=False)["input_ids"]
    return any(sum(c.isdigit() for c in tokenizer.decode([i])) > 1 for i in ids)


def is_multimodal(processor) -> bool:
    """True for an image+text processor, False for a plain tokenizer."""
    from transformers import ProcessorMixin

    return isinstance(processor, ProcessorMixin) and hasattr(processor, "image_processor")


def tokenizer_of(processor):
    """The tokenizer inside a processor, or the tokenizer itself."""
    from transformers import ProcessorMixin

    return processor.tokenizer if isinstance(processor, ProcessorMixin) else processor


VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"

# Where Hub folders name their processor class, newest layout first.
_PROCESSOR_CLASS_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def _declared_processor_class(model_dir: Path):
    """The processor class the folder asks for (as AutoProcessor finds it), or None for a plain tokenizer."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    for file_name in _PROCESSOR_CLASS_FILES:
        config_file = model_dir / file_name
        if config_file.is_file():
            name = json.loads(config_file.read_text()).get("processor_class")  # optional key in HF's files
            if name:
                return _without_torchvision(name, getattr(transformers, name, None))
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    model_type = json.loads(config_file.read_text()).get("model_type")  # older configs may lack it
    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    return _without_torchvision(name, getattr(transformers, name, None)) if name else None


# Processor classes transformers marks as needing torchvision only because their module imports one helper
# from the torchvision image processor's module, a helper the PIL image processor's module defines too
# (Pixtral's `get_resize_output_image_size`, used only to count image tokens for serving). Where
# torchvision is missing, the module is imported with the PIL module standing in for that one import:
# the stock class, with the PIL image processor its folder saves (`PixtralImageProcessorPil`).
_PIL_STAND_INS = {"PixtralProcessor": "pixtral"}


def _without_torchvision(name: str, processor_class):
    """The stock processor class where transformers gives a torchvision placeholder for it (see
    `_PIL_STAND_INS`); any other class as it is."""
    import importlib
    import sys

    from transformers.utils import is_torchvision_available

    if (
        name not in _PIL_STAND_INS
        or is_torchvision_available()
        or not getattr(processor_class, "is_dummy", 0)
    ):
        return processor_class
    package = f"transformers.models.{_PIL_STAND_INS[name]}"
    torchvision_module = f"{package}.image_processing_{_PIL_STAND_INS[name]}"
    pil = importlib.import_module(f"{package}.image_processing_pil_{_PIL_STAND_INS[name]}")
    sys.modules[torchvision_module] = pil
    try:
        module = importlib.import_module(f"{package}.processing_{_PIL_STAND_INS[name]}")
    finally:
        del sys.modules[torchvision_module]  # a later import still finds the real module (and its error)
    return getattr(module, name)


def _processor_settings(model_dir: Path, processor_class: type) -> dict:
    """The processor's own settings saved in processor_config.json (e.g. InternVL's image_seq_length, the
    tokens per image tile), as AutoProcessor passes them: only the class's named __init__ arguments."""
    config_file = model_dir / "processor_config.json"
    if not config_file.is_file():
        return {}
    accepted = set(inspect.signature(processor_class.__init__).parameters) - {"self", "chat_template"}
    accepted -= set(processor_class.get_attributes())  # the sub-processors are built separately
    return {k: v for k, v in json.loads(config_file.read_text()).items() if k in accepted}


def _folder_chat_template(model_dir: Path) -> str | None:
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).chat_template


@functools.cache
def _image_only_class(processor_class: type) -> type:
    """Subclass of `processor_class` whose sub-processors are just the image processor and tokenizer."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # The stock __init__ passes (image_processor, tokenizer, None); ProcessorMixin pairs positional
        # arguments with this class's attributes, so the missing video processor is simply not set.
        processor_class.__init__(
            self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs
        )

    # The stock signature less the video processor: transformers reads the sub-processors from it, and
    # `to_dict` saves the other arguments it names (e.g. InternVL's image_seq_length).
    stock = inspect.signature(processor_class.__init__)
    unbuilt = set(processor_class.get_attributes()) - {"image_processor", "tokenizer"}
    __init__.__signature__ = stock.replace(
        parameters=[p for p in stock.parameters.values() if p.name not in unbuilt]
    )

    def save_pretrained(self, save_directory, *args, **kwargs):
        saved = processor_class.save_pretrained(self, save_directory, *args, **kwargs)
        # The video processor was never built here: carry its config over, so that the saved folder
        # still loads with the stock AutoProcessor where torchvision exists.
        video_config = Path(self.source_dir) / VIDEO_PROCESSOR_CONFIG
        if video_config.is_file():
            shutil.copyfile(video_config, Path(save_directory) / VIDEO_PROCESSOR_CONFIG)
        return saved

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        # SmolVLM's own version reads video-sampling defaults from the (absent) video processor; without
        # videos ProcessorMixin's renders the same text. (Qwen-VL and InternVL do not override it.)
        from transformers import ProcessorMixin

        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)

    # Named like the stock class: save_pretrained writes that name, so saved folders load anywhere.
    return type(
        processor_class.__name__,
        (processor_class,),
        {
            "__init__": __init__,
            "save_pretrained": save_pretrained,
            "apply_chat_template": apply_chat_template,
        },
    )
