"""dtype="auto" (chapter 7, section 13): on a CPU the loader asks chapter 7's rule, which
measures a bfloat16 and a float32 matmul once and picks bfloat16 only where it is at least
AUTO_BF16_SPEEDUP times as fast; it says its choice once; without "auto" nothing changes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import minillm.perf.dtype_auto as perf
from minillm.engine import LLM
from minillm.model.loader import DTYPE_RULES, load_model

TINY = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"


@pytest.fixture
def speedup(monkeypatch):
    """Set what the measurement 'found' (and forget what was said)."""
    def set_to(value: float):
        monkeypatch.setattr(perf, "cpu_bf16_speedup", lambda: value)
        monkeypatch.setattr("minillm.model.sources._ANNOUNCED", set())
    return set_to


def test_the_rule_is_registered_for_the_cpu_by_importing_the_package():
    import minillm  # noqa: F401
    assert DTYPE_RULES["cpu"] is perf.cpu_auto_dtype


@pytest.mark.parametrize("measured, expected", [
    (2.0, torch.bfloat16), (1.3, torch.bfloat16), (1.29, torch.float32),
    (0.5, torch.float32)])
def test_auto_follows_the_measured_speedup(speedup, measured, expected, capsys):
    speedup(measured)
    model = load_model(TINY, dtype="auto")
    assert model.embed_tokens.weight.dtype == expected
    assert model.layers[0].mlp.up_proj.weight.dtype == expected
    said = capsys.readouterr().err
    assert f"dtype='auto': {str(expected)[6:]} on this CPU" in said
    assert f"{measured:.2f}x" in said
    load_model(TINY, dtype="auto")  # said once per process, not at every load
    assert "dtype='auto'" not in capsys.readouterr().err


def test_without_auto_the_cpu_default_stays_float32(speedup):
    speedup(3.0)
    assert load_model(TINY).embed_tokens.weight.dtype == torch.float32
    assert LLM(str(TINY), max_model_len=64).engine.model.embed_tokens.weight.dtype \
        == torch.float32


def test_llm_takes_auto_for_a_folder_and_for_a_loaded_model(speedup):
    speedup(3.0)
    llm = LLM(str(TINY), dtype="auto", max_model_len=64)
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


def test_the_measurement_is_a_positive_ratio_and_made_once():
    perf.cpu_bf16_speedup.cache_clear()
    first = perf.cpu_bf16_speedup(repeats=3)
    assert first > 0 and perf.cpu_bf16_speedup(repeats=3) == first
