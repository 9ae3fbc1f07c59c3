"""Folders the benchmarks build once and reuse (chapter 3's `cached_build`): a copy is
reused only when it was built from exactly the same recipe (config, seed, library
versions, the builder's source), so a folder that an older version left in the temp
directory is rebuilt, never trusted by its name. And a random folder of every Llama
preset builds in an empty temp directory and loads in both minillm and transformers."""
import json
import tempfile

import pytest
import torch
import transformers

from minillm.bench import folders as bench
from minillm.memory import PRESETS
from minillm.model.loader import load_model

LLAMAS = sorted(p for p, c in PRESETS.items() if c["model_type"] == "llama")
SMALL = {"num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 256}


@pytest.fixture
def empty_tmp(tmp_path, monkeypatch):
    """tempfile.gettempdir() is a new, empty folder for this test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def writer(calls: list, text: str = "built"):
    def build(path):
        calls.append(path)
        (path / "weights.txt").write_text(text)
    return build


def test_same_recipe_is_reused_a_new_one_rebuilt(empty_tmp):
    calls = []
    first = bench.cached_build("thing", {"a": 1}, writer(calls))
    assert first.parent == empty_tmp and first.name.startswith("thing-")
    assert bench.cached_build("thing", {"a": 1}, writer(calls)) == first
    assert len(calls) == 1  # reused: not built again
    other = bench.cached_build("thing", {"a": 2}, writer(calls))
    assert other != first and len(calls) == 2  # another recipe, another folder
    assert json.loads((other / bench.BUILD_STAMP).read_text()) == {"a": 2}
    assert sorted(p.name for p in empty_tmp.iterdir()) == sorted([first.name, other.name])


def test_a_stale_folder_is_rebuilt_in_place(tmp_path):
    folder, calls = tmp_path / "model", []
    bench.cached_build("thing", {"version": 1}, writer(calls, "old"), folder)
    bench.cached_build("thing", {"version": 2}, writer(calls, "new"), folder)
    assert len(calls) == 2
    assert (folder / "weights.txt").read_text() == "new"
    assert json.loads((folder / bench.BUILD_STAMP).read_text()) == {"version": 2}
    (folder / bench.BUILD_STAMP).write_text('{"vers')  # a torn stamp: rebuilt too
    bench.cached_build("thing", {"version": 2}, writer(calls, "again"), folder)
    assert (folder / "weights.txt").read_text() == "again"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp folder left


def test_a_folder_it_did_not_build_is_refused_untouched(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="my-model.*not built here"):
        bench.cached_build("thing", {"a": 1}, writer([]), folder)
    assert [p.name for p in folder.iterdir()] == ["config.json"]


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    folder = tmp_path / "model"

    def broken(path):
        (path / "half.bin").write_bytes(b"x")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        bench.cached_build("thing", {"a": 1}, broken, folder)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_from_an_older_version_is_not_reused(empty_tmp):
    """What broke chapter 3 on a fresh machine: the old code named the folder after
    the preset alone, so any copy at that name was trusted."""
    old = empty_tmp / "minillm-random-smollm2-135m"
    old.mkdir()
    (old / "config.json").write_text('{"hidden_size": 1}')
    (old / "model.safetensors").write_bytes(b"")
    folder = bench.random_model_folder("SmolLM2-135M", **SMALL)
    assert folder != old and folder.parent == empty_tmp
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 576


def test_the_recipe_changes_with_the_seed_the_overrides_and_the_code(empty_tmp):
    a = bench.random_model_folder("SmolLM2-135M", **SMALL)
    assert bench.random_model_folder("SmolLM2-135M", **SMALL) == a
    assert bench.random_model_folder("SmolLM2-135M", seed=1, **SMALL) != a
    assert bench.random_model_folder("SmolLM2-135M", **{**SMALL, "vocab_size": 128}) != a
    recipe = json.loads((a / bench.BUILD_STAMP).read_text())
    assert recipe["code"] == bench.source_hash(bench.random_model_folder)
    assert recipe["transformers"] == transformers.__version__
    assert bench.source_hash(bench.random_model_folder) != bench.source_hash(
        bench.cached_build)


def test_bad_presets_and_overrides_are_refused():
    with pytest.raises(ValueError, match="preset='GPT-5'.*allowed"):
        bench.random_model_folder("GPT-5")
    with pytest.raises(ValueError, match="Qwen2 shape"):
        bench.random_model_folder("Qwen2.5-0.5B")
    with pytest.raises(ValueError, match=r"\['num_layers'\] are not preset fields"):
        bench.random_model_folder("SmolLM2-135M", num_layers=2)


@pytest.mark.parametrize("preset", LLAMAS)
def test_every_llama_preset_builds_and_loads_in_both(preset, empty_tmp):
    folder = bench.random_model_folder(preset, **SMALL)
    assert folder.parent == empty_tmp
    config = json.loads((folder / "config.json").read_text())
    for key, value in {**PRESETS[preset], **SMALL}.items():
        assert config[key] == value, key
    ours = load_model(folder, dtype=torch.float32, device="cpu")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                               dtype=torch.float32)
    assert ours.config.num_layers == 2 and ours.config.head_dim == PRESETS[preset][
        "head_dim"]
    ids = torch.randint(0, SMALL["vocab_size"], (1, 12), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids, torch.arange(12)[None])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
