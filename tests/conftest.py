"""Shared test setup: CPU-only DeepSpeed, one thread per rank, a kept cache for JIT-compiled ops."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["tests.phase_ceiling"]  # one test's setup or call above the ceiling fails

# Set before any test imports torch/deepspeed: 2 cores are shared by all ranks of a test.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded at run time


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run tests/gpu/ on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
