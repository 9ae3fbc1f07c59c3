"""dtype="auto" (chapter 7's appendix, section 2): on a CPU the loader asks chapter 7's
rule, which reads facts that do not change between runs, the checkpoint's dtype (and the
quantization mode) and the CPU's bfloat16 instructions, and never a timing; it says its
choice once; without "auto" nothing changes."""
from __future__ import annotations

import itertools
import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

import minillm.perf.dtype_auto as perf
from minillm.engine import LLM
from minillm.model.config import ModelConfig
from minillm.model.loader import DTYPE_RULES, load_model, resolve_dtype

TINY = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"
CPU = torch.device("cpu")


@pytest.fixture
def features(monkeypatch):
    """Set the bfloat16 instructions the CPU 'has' (and forget what was said)."""
    def set_to(found: list[str]):
        monkeypatch.setattr(perf, "cpu_bf16_features", lambda: list(found))
        monkeypatch.setattr("minillm.model.sources._ANNOUNCED", set())
    return set_to


def saved_as(tmp_path: Path, dtype: str | None) -> Path:
    """The bundled model with config.json's torch_dtype set to `dtype`."""
    folder = tmp_path / f"tiny-{dtype}"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_rule_is_registered_for_the_cpu_by_importing_the_package():
    import minillm  # noqa: F401
    assert DTYPE_RULES["cpu"] is perf.cpu_auto_dtype


@pytest.mark.parametrize("saved, quantization, found, expected", [
    ("bfloat16", None, ["AVX-512 BF16"], torch.bfloat16),
    ("float16", None, ["AMX"], torch.bfloat16),
    ("bfloat16", None, [], torch.float32),
    ("float32", None, ["AVX-512 BF16", "AMX"], torch.float32),
    (None, None, ["AVX-512 BF16"], torch.float32),
    ("float32", "int8", ["AVX-512 BF16"], torch.bfloat16),
    ("float32", "int4", ["AMX"], torch.bfloat16),
    ("float32", "int8", [], torch.float32),
    ("float32", "int8-a8", ["AVX-512 BF16"], torch.float32),  # its kernel reads float32
])
def test_auto_follows_the_checkpoint_and_the_cpu(tmp_path, features, saved,
                                                 quantization, found, expected,
                                                 capsys):
    features(found)
    folder = saved_as(tmp_path, saved)
    model = load_model(folder, dtype="auto", quantization=quantization)
    assert model.embed_tokens.weight.dtype == expected
    said = capsys.readouterr().err
    assert f"dtype='auto': {str(expected)[6:]} on this CPU" in said
    assert (", ".join(found) or "none") in said
    load_model(folder, dtype="auto", quantization=quantization)  # said once
    assert "dtype='auto'" not in capsys.readouterr().err


def test_the_choice_does_not_depend_on_timings(monkeypatch):
    """A clock that jumps at random changes nothing: nothing in the rule is timed."""
    config = ModelConfig.from_hf(TINY)
    before = [resolve_dtype(config, "auto", CPU, q) for q in (None, "int8")]
    jumps = itertools.accumulate(random.Random(0).random() for _ in range(10**6))
    monkeypatch.setattr(time, "perf_counter", lambda: next(jumps))
    monkeypatch.setattr(time, "monotonic", lambda: next(jumps))
    for _ in range(5):
        assert [resolve_dtype(config, "auto", CPU, q) for q in (None, "int8")] == before
    expected = torch.bfloat16 if perf.cpu_bf16_features() else torch.float32
    assert before == [torch.float32, expected]


def test_the_features_are_what_torch_reports():
    found = perf.cpu_bf16_features()
    assert set(found) <= {"AVX-512 BF16", "AMX"}
    assert ("AVX-512 BF16" in found) == torch.cpu._is_avx512_bf16_supported()


def test_without_auto_the_cpu_default_stays_float32(tmp_path, features):
    features(["AMX"])
    folder = saved_as(tmp_path, "bfloat16")
    assert load_model(folder).embed_tokens.weight.dtype == torch.float32
    assert LLM(str(folder), max_model_len=64).engine.model.embed_tokens.weight.dtype \
        == torch.float32


def test_llm_takes_auto_for_a_folder_and_for_a_loaded_model(tmp_path, features):
    features(["AVX-512 BF16"])
    llm = LLM(str(saved_as(tmp_path, "bfloat16")), dtype="auto", max_model_len=64)
    assert llm.engine.model.embed_tokens.weight.dtype == torch.bfloat16
    loaded = load_model(TINY)
    llm = LLM(loaded, dtype="auto", max_model_len=64)  # nothing to change: accepted
    assert llm.engine.model is loaded
    with pytest.raises(ValueError, match="dtype"):
        LLM(loaded, dtype="bfloat16", max_model_len=64)


@pytest.mark.parametrize("bad", ["Auto", "automatic", "float64", 3])
def test_other_dtype_names_are_refused_before_loading(bad):
    with pytest.raises(ValueError, match="dtype"):
        load_model(TINY, dtype=bad)
