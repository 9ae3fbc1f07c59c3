"""The source article's task (minillm.bench.article, Chapter 7): checked on a CPU with
the bundled model and a random small Llama; the 8 GB / 200 ms targets need a GPU."""
import pytest
import torch

from minillm.bench import article
from minillm.bench.cli import dispatch
from minillm.memory import PRESETS, parameter_count
from minillm.utils import bundled_model_path


def test_runs_on_a_cpu_and_reports_against_the_targets():
    r = article.article_task(bundled_model_path(), "cpu", prompt_tokens=40,
                             max_model_len=64, repeats=1)
    assert r["device"] == "cpu" and r["gpu_used_GB"] is None and r["memory_ok"] is None
    assert r["prompt_tokens"] == 40  # no chat template: random ids, exactly n
    assert r["first_token_ok"] == (r["first_token_s"] <= 0.2)
    assert r["weights_GB"] > 0 and r["kv_pool_GB"] > 0
    assert r["answer"]  # the bundled model has a tokenizer: a short answer
    text = article.format_task(r)
    assert "not measured on a CPU" in text and "40-token prompt" in text


def test_chat_prompt_fills_the_template_up_to_n_tokens(monkeypatch):
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(bundled_model_path())
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %} A:{% endif %}")
    for n in (60, 128):
        ids = article.chat_prompt(tok, n)
        assert n - 12 < len(ids) <= n
        assert tok.decode(ids).endswith("where did the market move? A:")


def test_int8_arithmetic():
    shape = PRESETS["Llama-2-7B"]
    tables = shape["vocab_size"] * shape["hidden_size"] * 2
    assert article.int8_bytes(shape) == parameter_count(shape) + tables
    assert 6.5e9 < article.int8_bytes(shape) < 7.5e9
    assert article.int8_bytes(PRESETS["Qwen2.5-7B"]) > 8e9


@pytest.mark.parametrize("kw, message", [
    ({"prompt_tokens": 0}, "prompt_tokens=0"),
    ({"repeats": True}, "repeats=True"),
    ({"prompt_tokens": 64, "max_model_len": 64}, "must exceed prompt_tokens=64"),
    ({"quantization": "int3"}, "quantization='int3'"),
])
def test_bad_arguments_fail_before_loading(kw, message, monkeypatch):
    monkeypatch.setattr("minillm.model.loader.load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=message):
        article.article_task(bundled_model_path(), "cpu", **kw)


def test_gpu_memory_is_none_on_a_cpu():
    assert article.gpu_memory_used(torch.device("cpu")) is None


def test_command_prints_and_writes(tmp_path, capsys):
    status = dispatch(["article", "--model", str(bundled_model_path()), "--device", "cpu",
                       "--prompt-tokens", "32", "--max-model-len", "64", "--repeats",
                       "1", "--out", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    assert "first token of a 32-token prompt" in out
    (csv,) = tmp_path.glob("article_*_cpu.csv")
    assert "first_token_s" in csv.read_text()
    with pytest.raises(SystemExit) as e:
        dispatch(["article", "--model", str(bundled_model_path()), "--threads", "999"])
    assert e.value.code == 2


def test_a_preset_runs_on_random_weights(monkeypatch):
    """The GPU check's path (--model Llama-2-7B), on a small shape: nothing is read from
    disk, the linear layers are int8."""
    from minillm.quant.int8 import Int8Linear
    monkeypatch.setitem(PRESETS, "Tiny-Llama-test", {**PRESETS["SmolLM2-135M"],
                                                     "num_hidden_layers": 2})
    monkeypatch.setattr("minillm.model.loader.load_model", lambda *a, **k: pytest.fail("read"))
    net = article.random_model("Tiny-Llama-test", torch.device("cpu"), torch.float32,
                               "int8")
    assert sum(isinstance(m, Int8Linear) for m in net.modules()) == 2 * 7
    r = article.article_task("Tiny-Llama-test", "cpu", prompt_tokens=16,
                             max_model_len=32, repeats=1)
    assert r["prompt_tokens"] == 16 and r["answer"] == ""
