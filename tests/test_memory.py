"""The memory formulas of Chapter 0: checked against hand-computed values, against the
parameters of real models (minillm's and transformers'), and for clear errors."""
import json
import re
from pathlib import Path
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
import transformers

from minillm.memory import (DTYPE_BYTES, GPU_MEMORY_MIB, PRESETS, dtype_bytes, dtype_name,
                            format_gib, head_dim, kv_cache_bytes, memory_calculator_html,
                            memory_report, parameter_count, weight_bytes)
from minillm.model.config import ModelConfig
from minillm.model.transformer import Transformer
from minillm.utils import bundled_model_path

LLAMA2_7B_LIKE = {"num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 128}
SMALL = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 10, "intermediate_size": 12,
         "tie_word_embeddings": False}


class AttrConfig:
    """An object-style config, like transformers.PretrainedConfig."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_source_article_example_is_one_gib():
    assert kv_cache_bytes(LLAMA2_7B_LIKE, seq_len=2048, batch_size=1, dtype="float16") == 2**30


def test_kv_formula_by_hand():
    cfg = {"num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
           "hidden_size": 48}
    # 2 (K and V) * 3 layers * 2 kv heads * 8 head_dim * 5 tokens * 4 batch * 4 bytes
    expected = 2 * 3 * 2 * 8 * 5 * 4 * 4
    assert kv_cache_bytes(cfg, seq_len=5, batch_size=4, dtype="float32") == expected


def test_gqa_uses_kv_heads_not_query_heads():
    mha = {"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 16}
    gqa = dict(mha, num_key_value_heads=2)
    assert kv_cache_bytes(mha, 10) == 4 * kv_cache_bytes(gqa, 10)


@pytest.mark.parametrize("name", list(DTYPE_BYTES))
def test_string_and_torch_dtypes_agree(name):
    """The same dtype as a name or as a torch dtype gives the same bytes everywhere,
    also in memory_report, whose INT8 rule keeps the KV cache in float16."""
    as_torch = getattr(torch, name)
    cfg = PRESETS["Llama-3.1-8B"]
    assert dtype_name(as_torch) == name and dtype_bytes(as_torch) == dtype_bytes(name)
    assert kv_cache_bytes(cfg, 100, 2, as_torch) == kv_cache_bytes(cfg, 100, 2, name)
    assert weight_bytes(cfg, as_torch) == weight_bytes(cfg, name)
    assert memory_report("Llama-3.1-8B", as_torch) == memory_report("Llama-3.1-8B", name)
    assert (memory_report("Llama-3.1-8B", "float16", kv_dtype=as_torch)
            == memory_report("Llama-3.1-8B", "float16", kv_dtype=name))


def test_int8_weights_keep_a_float16_cache_unless_told():
    r = memory_report("Llama-3.1-8B", torch.int8, 1000)
    assert r["kv_dtype"] == "float16"
    assert r["kv_cache_bytes"] == kv_cache_bytes(PRESETS["Llama-3.1-8B"], 1000, 1, "float16")
    r8 = memory_report("Llama-3.1-8B", "int8", 1000, kv_dtype="int8")
    assert r8["kv_cache_bytes"] * 2 == r["kv_cache_bytes"]


def test_dict_object_and_modelconfig_agree():
    cfg = PRESETS["Qwen2.5-0.5B"]
    mc = ModelConfig.from_hf(cfg | {"rms_norm_eps": 1e-6})
    for other in (AttrConfig(**cfg), mc):
        assert kv_cache_bytes(other, 100, 2) == kv_cache_bytes(cfg, 100, 2)
        assert weight_bytes(other, "bfloat16") == weight_bytes(cfg, "bfloat16")
        assert head_dim(other) == head_dim(cfg)


def test_numpy_integers_are_accepted():
    cfg = {k: np.int64(v) if isinstance(v, int) and not isinstance(v, bool) else v
           for k, v in PRESETS["SmolLM2-135M"].items()}
    assert kv_cache_bytes(cfg, np.int32(64), np.int64(2)) == kv_cache_bytes(
        PRESETS["SmolLM2-135M"], 64, 2)
    assert parameter_count(cfg) == parameter_count(PRESETS["SmolLM2-135M"])


def test_head_dim_derived_from_hidden_size():
    assert head_dim({"hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert head_dim({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 64}) == 64


def test_parameter_count_by_hand():
    hd = 4
    attention = 8 * 2 * hd * 2 + 8 * 1 * hd * 2       # q, o + k, v
    per_layer = attention + 3 * 8 * 12 + 2 * 8         # + MLP + two norms
    expected = 2 * 10 * 8 + 2 * per_layer + 8          # untied embeddings + layers + final norm
    assert parameter_count(SMALL) == expected
    assert parameter_count(dict(SMALL, tie_word_embeddings=True)) == expected - 80
    qkv_bias, o_bias = (2 + 2 * 1) * hd, 8
    assert parameter_count(dict(SMALL, model_type="qwen2")) == expected + 2 * qkv_bias
    assert parameter_count(dict(SMALL, attention_bias=True)) == expected + 2 * (qkv_bias + o_bias)
    assert parameter_count(dict(SMALL, model_type="qwen3")) == expected + 2 * 2 * hd


def _meta_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_count_of_the_bundled_model():
    config = ModelConfig.from_hf(bundled_model_path())
    with torch.device("meta"):
        model = Transformer(config)
    assert parameter_count(config) == _meta_count(model)
    hf = json.loads((bundled_model_path() / "config.json").read_text())
    assert parameter_count(hf) == _meta_count(model)


FAMILIES = [("LlamaConfig", {}), ("LlamaConfig", {"attention_bias": True}),
            ("LlamaConfig", {"tie_word_embeddings": True}), ("MistralConfig", {}),
            ("Qwen2Config", {}), ("Qwen3Config", {"head_dim": 24}),
            ("Qwen3Config", {"attention_bias": True, "head_dim": 24})]


@pytest.mark.parametrize("family,extra", FAMILIES,
                         ids=[f"{f}-{'-'.join(e) or 'plain'}" for f, e in FAMILIES])
def test_parameter_count_equals_the_real_models(family, extra):
    """Against the parameters of the module transformers and minillm build from it."""
    fields = dict(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, **extra)
    hf_config = getattr(transformers, family)(**fields)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
        minillm_model = Transformer(ModelConfig.from_hf(hf_config.to_dict()))
    real = _meta_count(hf_model)
    assert parameter_count(hf_config) == real            # the transformers object
    assert parameter_count(hf_config.to_dict()) == real  # its config.json
    assert parameter_count(ModelConfig.from_hf(hf_config.to_dict())) == real
    assert _meta_count(minillm_model) == real


@pytest.mark.parametrize("name,count", [("Llama-2-7B", 6_738_415_616),
                                        ("Llama-3.1-8B", 8_030_261_248),
                                        ("TinyLlama-1.1B", 1_100_048_384),
                                        ("Qwen2.5-0.5B", 494_032_768),
                                        ("Qwen2.5-7B", 7_615_616_512),
                                        ("SmolLM2-135M", 134_515_008)])
def test_presets_match_published_parameter_counts(name, count):
    assert parameter_count(PRESETS[name]) == count


def test_weight_bytes_scale_with_the_dtype():
    cfg = PRESETS["Llama-3.1-8B"]
    assert weight_bytes(cfg, "float32") == 2 * weight_bytes(cfg, "bfloat16")
    assert weight_bytes(cfg, "float16") == 2 * weight_bytes(cfg, "int8")


@pytest.mark.parametrize("nbytes,text", [(0, "0.00"), (2**30, "1.00"), (2**30 // 8, "0.13"),
                                         (2**30 * 3 // 8, "0.38"), (2**30 // 200 - 1, "0.00"),
                                         (15360 * 2**20, "15.00"), (10**12, "931.32")])
def test_format_gib_rounds_halves_up(nbytes, text):
    assert format_gib(nbytes) == text


def test_memory_report_adds_up_and_fits_exactly_at_the_capacity():
    """`fits` flips between the last token that fits in the GPU's memory and the next."""
    cfg = PRESETS["Llama-3.1-8B"]
    capacity = GPU_MEMORY_MIB["L4"] * 2**20
    per_token = kv_cache_bytes(cfg, 1)
    longest = (capacity - weight_bytes(cfg)) // per_token
    r = memory_report("Llama-3.1-8B", "float16", longest, 1, "L4")
    assert r["total_bytes"] == r["weights_bytes"] + r["kv_cache_bytes"] <= capacity
    assert r["gpu_bytes"] == capacity and r["fits"]
    assert r["total_GiB"] == pytest.approx(r["total_bytes"] / 2**30)
    assert not memory_report("Llama-3.1-8B", "float16", longest + 1, 1, "L4")["fits"]


def test_memory_report_within_context():
    assert memory_report("Llama-2-7B", seq_len=4096)["within_context"]
    assert not memory_report("Llama-2-7B", seq_len=4097)["within_context"]


@pytest.mark.parametrize("kwargs,field", [
    ({"seq_len": 0}, "seq_len"), ({"seq_len": -5}, "seq_len"), ({"seq_len": 2.5}, "seq_len"),
    ({"seq_len": 8.0}, "seq_len"), ({"seq_len": True}, "seq_len"), ({"seq_len": "8"}, "seq_len"),
    ({"seq_len": 8, "batch_size": 0}, "batch_size"),
    ({"seq_len": 8, "batch_size": -1}, "batch_size"),
    ({"seq_len": 8, "batch_size": 2.0}, "batch_size"),
    ({"seq_len": 8, "batch_size": False}, "batch_size"),
    ({"seq_len": 8, "dtype": "fp8"}, "fp8"), ({"seq_len": 8, "dtype": "Float16"}, "Float16"),
    ({"seq_len": 8, "dtype": torch.float64}, "float64"), ({"seq_len": 8, "dtype": None}, "None"),
    ({"seq_len": 8, "dtype": ["float16"]}, "float16"), ({"seq_len": 8, "dtype": 2}, "dtype=2"),
])
def test_bad_arguments_name_the_value(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        kv_cache_bytes(PRESETS["SmolLM2-135M"], **kwargs)


@pytest.mark.parametrize("missing", ["num_hidden_layers", "num_attention_heads"])
def test_missing_config_field_is_named(missing):
    cfg = dict(LLAMA2_7B_LIKE)
    del cfg[missing]
    with pytest.raises(ValueError, match=missing):
        kv_cache_bytes(cfg, 16)


def test_missing_head_dim_and_hidden_size():
    with pytest.raises(ValueError, match="hidden_size"):
        kv_cache_bytes({"num_hidden_layers": 2, "num_attention_heads": 4}, 16)
    with pytest.raises(ValueError, match="vocab_size"):
        weight_bytes({k: v for k, v in PRESETS["SmolLM2-135M"].items() if k != "vocab_size"})


@pytest.mark.parametrize("change,match", [
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({"num_key_value_heads": -2}, "num_key_value_heads=-2"),
    ({"num_key_value_heads": 5}, "not a multiple"),
    ({"num_key_value_heads": 64}, "not a multiple"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_attention_heads": True}, "num_attention_heads=True"),
    ({"num_hidden_layers": 32.0}, "num_hidden_layers=32.0"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers='32'"),
    ({"head_dim": 0}, "head_dim=0"),
    ({"num_layers": 30}, "disagree"),
])
def test_bad_config_values(change, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        kv_cache_bytes(dict(LLAMA2_7B_LIKE, **change), 16)


def test_bad_config_values_for_weights():
    with pytest.raises(ValueError, match="not divisible"):
        head_dim({"hidden_size": 100, "num_attention_heads": 3})
    with pytest.raises(ValueError, match="tie_word_embeddings='false'"):
        weight_bytes(dict(SMALL, tie_word_embeddings="false"))
    with pytest.raises(ValueError, match="mixtral"):
        parameter_count(dict(SMALL, model_type="mixtral"))
    with pytest.raises(ValueError, match="vocab_size=0"):
        parameter_count(dict(SMALL, vocab_size=0))


@pytest.mark.parametrize("config", [None, "Llama-3.1-8B", b"{}", 7, ["num_hidden_layers"]])
def test_things_that_are_not_configs(config):
    with pytest.raises(ValueError, match="not a model config"):
        kv_cache_bytes(config, 16)


def test_bad_input_is_rejected_before_the_config_is_read():
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes({}, 0)
    with pytest.raises(ValueError, match="fp8"):
        weight_bytes({}, "fp8")


@pytest.mark.parametrize("kwargs,match", [
    ({"model": "GPT-5"}, "GPT-5"), ({"model": ["Llama-2-7B"]}, "Llama-2-7B"),
    ({"model": "Llama-3.1-8B", "gpu": "V100"}, "V100"),
    ({"model": "Llama-3.1-8B", "gpu": "T4 16 GB"}, "T4 16 GB"),
    ({"model": "Llama-3.1-8B", "dtype": "fp16"}, "fp16"),
    ({"model": "Llama-3.1-8B", "kv_dtype": "int4"}, "int4"),
    ({"model": "Llama-3.1-8B", "seq_len": 0}, "seq_len"),
    ({"model": "Llama-3.1-8B", "batch_size": 1.5}, "batch_size"),
])
def test_memory_report_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        memory_report(**kwargs)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "1"])
def test_format_gib_rejects_what_is_not_a_byte_count(bad):
    with pytest.raises(ValueError, match="nbytes"):
        format_gib(bad)


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.scripts, self._script = [], {}, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "script":
            self._script = attrs.get("id") or attrs.get("class") or "code"
            self.scripts[self._script] = ""

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script:
            self.scripts[self._script] += data


def test_calculator_html_keeps_the_dom_contract():
    """What the website's browser test relies on (tests/browser): the names, the options,
    the outputs, and the cases embedded as JSON; the JavaScript's data come from Python."""
    cases = [{"inputs": {"preset": "SmolLM2-135M", "context": 9, "batch": 1,
                         "dtype": "int8"}, "expected": {"total_gib": "0.13"}}]
    page = _Collect()
    page.feed(memory_calculator_html(cases))
    tags = page.tags
    assert tags[0] == ("div", tags[0][1]) and tags[0][1]["id"] == "memory-calculator"
    names = {a.get("name"): t for t, a in tags if a.get("name")}
    assert names == {"preset": "select", "context": "input", "batch": "input",
                     "dtype": "select"}
    options = [a["value"] for t, a in tags if t == "option"]
    assert options == list(PRESETS) + list(DTYPE_BYTES)
    outs = {a["data-out"] for t, a in tags if "data-out" in a}
    assert {"weights_gib", "kv_gib", "total_gib"} <= outs
    assert json.loads(page.scripts["memory-calculator-cases"]) == cases
    data = json.loads(page.scripts["memory-calculator-data"])
    assert data["gpus"] == GPU_MEMORY_MIB and data["dtype_bytes"] == DTYPE_BYTES
    for name, shape in data["presets"].items():
        assert shape["head_dim"] == head_dim(PRESETS[name])
    assert "addEventListener(\"input\"" in page.scripts["code"]
    assert "addEventListener(\"change\"" in page.scripts["code"]


def test_calculator_html_rejects_bad_defaults():
    with pytest.raises(ValueError, match="GPT-5"):
        memory_calculator_html(preset="GPT-5")
    with pytest.raises(ValueError, match="context"):
        memory_calculator_html(context=0)


def _browser():
    """Debian's Chromium driven by Playwright, or a skip naming what is missing."""
    sync_api = pytest.importorskip("playwright.sync_api")
    import shutil
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.skip("no Chromium (apt-get install chromium); tests/browser needs it too")
    return sync_api, path


DRIVE = """cases => cases.map(([preset, dtype, context, batch]) => {
  const root = document.getElementById("memory-calculator");
  const set = (name, value) => {
    const box = root.querySelector(`[name=${name}]`);
    box.value = String(value);
    box.dispatchEvent(new Event("input", {bubbles: true}));
  };
  set("preset", preset); set("dtype", dtype); set("context", context); set("batch", batch);
  const text = (sel) => [...root.querySelectorAll(sel)].map((e) => e.textContent);
  return [text("[data-out=weights_gib], [data-out=kv_gib], [data-out=total_gib]"),
          text("[data-gpu]").map((t) => t === "✓ fits")];
})"""


def test_calculator_javascript_agrees_with_python(monkeypatch):
    """The JavaScript in the page against memory_report + format_gib, on every preset and
    dtype (plus two shapes the presets lack: Llama with biases, Qwen3), exact halves, the
    largest inputs it accepts, and bad inputs (no number)."""
    sync_api, chromium = _browser()
    # shapes where a bias or a norm vector per layer moves the GiB's second decimal
    big = dict(num_hidden_layers=200, vocab_size=1000, intermediate_size=1000,
               max_position_embeddings=4096)
    monkeypatch.setitem(PRESETS, "llama-bias", dict(
        big, hidden_size=16384, num_attention_heads=128, num_key_value_heads=8,
        head_dim=128, attention_bias=True))
    monkeypatch.setitem(PRESETS, "qwen3", dict(
        big, model_type="qwen3", hidden_size=1024, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32768))
    cases = [(p, d, c, b) for p in PRESETS for d in DTYPE_BYTES
             for c, b in [(1, 1), (1024, 1), (4096, 8), (2**20, 1024)]]
    cases += [("Llama-3.1-8B", "float16", 1024, 1), ("Llama-2-7B", "int8", 3, 7)]
    expected = []
    for preset, dtype, context, batch in cases:
        r = memory_report(preset, dtype, context, batch)
        expected.append([[format_gib(r[k]) for k in ("weights_bytes", "kv_cache_bytes",
                                                      "total_bytes")],
                         [memory_report(preset, dtype, context, batch, g)["fits"]
                          for g in GPU_MEMORY_MIB]])
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium,
                                    args=["--no-sandbox", "--headless"])
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_content(memory_calculator_html())
        shown = page.evaluate(DRIVE, [list(c) for c in cases])
        calc = page.locator("#memory-calculator")  # and once through real key presses
        calc.locator("select[name=preset]").select_option("SmolLM2-135M")
        calc.locator("select[name=dtype]").select_option("float16")
        calc.locator("input[name=context]").fill("8192")
        calc.locator("input[name=batch]").fill("1")
        by_hand = calc.locator("[data-out=total_gib]").text_content()
        calc.locator("input[name=batch]").fill("0")
        bad = calc.locator("[data-out=total_gib]").text_content()
        message = calc.locator("[data-out=message]").text_content()
        browser.close()
    wrong = [f"{c}: page {s}, Python {e}" for c, s, e in zip(cases, shown, expected)
             if s != e]
    assert not wrong, "\n".join(wrong)
    assert by_hand == format_gib(memory_report("SmolLM2-135M", "float16", 8192)["total_bytes"])
    assert bad == "–" and "batch" in message and not errors
