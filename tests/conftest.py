"""Fixtures shared by the unit tests (the plain functions behind them are in helpers.py)."""
import pytest

from helpers import make_hf_model, make_model_pair


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers model, minillm model) with the same random weights: a Llama with GQA,
    weights drawn wide so that greedy decoding wanders. Built once per test module."""
    return make_model_pair(tmp_path_factory.mktemp("llama"), "llama_gqa_untied", "wide")


@pytest.fixture(scope="module")
def folder_weights():
    """The `weights` of make_hf_model for `folder`; a module overrides this fixture to
    change them."""
    return "init"


@pytest.fixture(scope="module")
def folder(tmp_path_factory, folder_weights):
    """A tiny random Llama saved in Hugging Face format (no tokenizer), in a folder whose
    name has a space, on purpose: "tiny model". Built once per test module."""
    path = tmp_path_factory.mktemp("models") / "tiny model"
    make_hf_model(path, "llama_gqa_untied", folder_weights)
    return path


def needs_cuda(item) -> bool:
    """Marked `cuda`. Not `"cuda" in item.keywords`: that also matches a parametrize
    id such as test_devices_this_machine_lacks[cuda], which then ran nowhere."""
    return item.get_closest_marker("cuda") is not None


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU: skipped without one (tools/gpu_check.sh)."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tools/gpu_check.sh on one)")
    for item in items:
        if needs_cuda(item):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def served():
    """A server of the tiny model for one test module: (its URL, its engine). The engine
    is checked empty after the server stopped."""
    from test_serve import NAME, tiny_llm

    from minillm.serve.app import build_app
    from minillm.serve.cli import BackgroundServer
    llm = tiny_llm(max_num_seqs=4)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm.engine
    assert not llm.engine.requests and not llm.engine.has_unfinished()
