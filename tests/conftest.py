"""Fixtures shared by the unit tests (the plain functions behind them are in helpers.py)."""
import pytest

from helpers import make_model_pair


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers model, minillm model) with the same random weights: a Llama with GQA,
    weights drawn wide so that greedy decoding wanders. Built once per test module."""
    return make_model_pair(tmp_path_factory.mktemp("llama"), "llama_gqa_untied", "wide")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU: skipped without one (tools/gpu_check.sh)."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tools/gpu_check.sh on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
