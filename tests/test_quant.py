"""minillm.quant.int8 (chapter 5): absmax int8 quantization keeps every weight within half a step;
W8A16 and W8A8 layers compute what their int math says (also through the exact float64 path);
quantize() swaps the right layers, refuses bad input without changing anything, and the
quantized model runs in chapter 3's loop and chapter 4's engine with the same tokens, while the
model file on disk stays untouched. SmoothQuant's folding leaves the float model's function
unchanged and fixes W8A8 on a planted outlier channel; gguf_quantize writes llama.cpp's bytes."""
from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from minillm.engine import LLM
from minillm.generate import generate
from minillm.model.loader import load_model
from minillm.quant.int8 import (FbgemmLinear, Int8Int8Linear, Int8Linear, PackedInt8Linear,
                           absmax_quantize,
                           activation_absmax, bnb_missing, dequantize, exact_int8_matmul,
                           fbgemm_missing, int8_layers_on_meta, int8_matmul, is_quantized, perplexity,
                           quantize, smooth)
from minillm.quant.formats import gguf_quantize, gguf_round_trip
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer

torch.set_num_threads(1)

SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"


@pytest.fixture(scope="module")
def shakespeare():
    return load_model(SHAKESPEARE, dtype=torch.float32, device="cpu")


def state(model: nn.Module) -> dict:
    """Every parameter and buffer, cloned, with the module classes: to check 'unchanged'."""
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    return {"tensors": tensors, "classes": [type(m) for m in model.modules()]}


def same_state(a: dict, b: dict) -> bool:
    return (a["classes"] == b["classes"] and a["tensors"].keys() == b["tensors"].keys()
            and all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"]))


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16, bias=False))


# --- absmax_quantize -----------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [None, 1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step(group_size, dtype):
    torch.manual_seed(1)
    w = (torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]).to(dtype)
    w[3, 5] = 40.0  # an outlier only widens its own row's (or group's) step
    q, s = absmax_quantize(w, group_size)
    groups = 1 if group_size is None else 64 // group_size
    assert q.dtype == torch.int8 and q.shape == (48, 64)
    assert s.dtype == torch.float32 and s.shape == (48, groups)
    assert q.abs().max() <= 127 and (q.view(48, groups, -1).abs().amax(-1) == 127).all()
    steps = s.repeat_interleave(64 // groups, dim=1)
    err = (w.float() - dequantize(q, s)).abs()
    assert (err <= steps / 2 * (1 + 1e-5)).all()


def test_groups_give_smaller_errors_than_channels():
    torch.manual_seed(2)
    w = torch.randn(32, 256)
    w[:, 0] = 20.0  # one large input column: groups keep it out of the other groups' steps
    errors = {g: (w - dequantize(*absmax_quantize(w, g))).abs().mean() for g in (None, 32)}
    assert errors[32] < errors[None] / 2


def test_zero_rows_stay_zero():
    w = torch.zeros(4, 8)
    w[1] = torch.linspace(-1, 1, 8)
    q, s = absmax_quantize(w)
    assert torch.equal(q[0], torch.zeros(8, dtype=torch.int8)) and torch.isfinite(s).all()
    assert torch.equal(dequantize(q, s)[0], torch.zeros(8))


@pytest.mark.parametrize("w, group_size, match", [
    (torch.randn(8), None, r"2-D"),
    (torch.randn(2, 8, 8), None, r"2-D"),
    (torch.ones(4, 8, dtype=torch.int32), None, r"float"),
    ([[1.0, 2.0]], None, r"list"),
    (torch.randn(4, 8), 3, r"group_size=3 .*in_features=8"),
    (torch.randn(4, 8), 0, r"group_size=0"),
    (torch.randn(4, 8), 16, r"group_size=16"),
    (torch.randn(4, 8), 2.0, r"group_size=2.0"),
    (torch.randn(4, 8), True, r"group_size=True"),
])
def test_absmax_quantize_refuses_bad_input(w, group_size, match):
    with pytest.raises(ValueError, match=match):
        absmax_quantize(w, group_size)


# --- the layers ----------------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("bias", [True, False])
def test_w8a16_layer_is_the_float_layer_of_its_dequantized_weight(group_size, bias):
    torch.manual_seed(3)
    linear = nn.Linear(64, 24, bias=bias)
    before = copy.deepcopy(linear.state_dict())
    layer = Int8Linear.from_linear(linear, group_size)
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (24, 64)
    assert layer.scale.shape == (24, 1 if group_size is None else 4)
    assert [n for n, _ in layer.named_parameters()] == (["bias"] if bias else [])
    x = torch.randn(2, 5, 64)
    q, s = absmax_quantize(linear.weight, group_size)
    expected = nn.functional.linear(x, dequantize(q, s), linear.bias)
    torch.testing.assert_close(layer(x), expected)
    assert layer(x).shape == (2, 5, 24)
    assert all(torch.equal(before[k], v) for k, v in linear.state_dict().items())


def test_w8a16_keeps_the_activation_dtype():
    linear = nn.Linear(32, 8).to(torch.bfloat16)
    layer = Int8Linear.from_linear(linear)
    assert layer.scale.dtype == torch.bfloat16
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    torch.testing.assert_close(layer(x).float(), linear(x).float(), atol=0.1, rtol=0.05)


def int_reference(layer: Int8Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """W8A8 in float64: per-token absmax of x, integer sums, both scales, the bias."""
    rows = x.reshape(-1, x.shape[-1]).double()
    sx = (rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127).float().double()
    qx = (rows.float() / sx.float()).round().clamp(-127, 127).double()
    y = (qx @ layer.weight.double().T) * sx * layer.scale.double().view(1, -1)
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_w8a8_equals_a_float64_reference_of_the_int_math(rows):
    torch.manual_seed(4)
    linear = nn.Linear(96, 40)
    layer = Int8Int8Linear.from_linear(linear)
    x = torch.randn(rows, 96) * 3
    torch.testing.assert_close(layer(x).double(), int_reference(layer, x),
                               atol=1e-5, rtol=1e-5)
    rel = (layer(x) - linear(x)).norm() / linear(x).norm()
    assert rel < 0.02


def test_int8_matmul_is_exact():
    torch.manual_seed(5)
    a = torch.randint(-127, 128, (7, 4096), dtype=torch.int8)
    b = torch.randint(-127, 128, (4096, 24), dtype=torch.int8)
    out = int8_matmul(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), a.long() @ b.long())


@pytest.mark.parametrize("k, value", [(1024, -128), (1041, 127), (1041, -128)])
def test_int8_matmul_fallback_is_exact_at_the_float32_limit(k, value):
    """Float32 holds every integer up to 2**24: 1024 x (-128)^2 is exactly 2**24, and
    1041 x 127^2 = 16790289 (odd, above 2**24) would round in float32."""
    a = torch.full((2, k), value, dtype=torch.int8)
    b = torch.full((k, 3), value, dtype=torch.int8)
    with exact_int8_matmul():
        out = int8_matmul(a, b)
    assert out.dtype == torch.int32
    assert (out.long() == k * value * value).all()


def test_w8a8_refuses_groups():
    with pytest.raises(ValueError, match=r"group_size=16"):
        Int8Int8Linear(64, 8, group_size=16)


# --- quantize() ----------------------------------------------------------------------------

def linear_names(model: nn.Module, cls=nn.Linear) -> set[str]:
    return {n for n, m in model.named_modules() if type(m) is cls}


@pytest.mark.parametrize("mode, cls", [("w8a16", Int8Linear), ("w8a8", Int8Int8Linear)])
def test_quantize_swaps_every_linear_but_lm_head(shakespeare, mode, cls):
    model = copy.deepcopy(shakespeare)
    names = linear_names(model)
    assert quantize(model, mode) is model
    assert linear_names(model, cls) == names - {"lm_head"}
    assert linear_names(model) == {"lm_head"}
    assert torch.equal(model.lm_head.weight, shakespeare.lm_head.weight)
    assert is_quantized(model) and not is_quantized(shakespeare)
    layer = model.layers[2].mlp.down_proj
    q, s = absmax_quantize(shakespeare.layers[2].mlp.down_proj.weight)
    assert torch.equal(layer.weight, q) and torch.equal(layer.scale, s)


def test_quantize_skips_by_name_or_full_path(shakespeare):
    model = quantize(copy.deepcopy(shakespeare), "w8a16",
                     skip=("lm_head", "down_proj", "layers.0.self_attn.q_proj"))
    floats = linear_names(model)
    assert floats == {"lm_head", "layers.0.self_attn.q_proj"} | {
        f"layers.{i}.mlp.down_proj" for i in range(len(model.layers))}
    everything = quantize(copy.deepcopy(shakespeare), "w8a16", skip=())
    assert linear_names(everything) == set()


def test_quantize_with_groups(shakespeare):
    model = quantize(copy.deepcopy(shakespeare), "w8a16", group_size=32)
    layer = model.layers[0].mlp.down_proj  # 704 inputs
    assert layer.group_size == 32 and layer.scale.shape == (layer.out_features, 704 // 32)


def test_quantized_bytes_are_about_half_of_float16(shakespeare):
    model = quantize(copy.deepcopy(shakespeare), "w8a16")
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    int8 = sum(t.numel() * t.element_size() for m in layers
               for t in [*m.buffers(), *m.parameters()])
    fp16 = sum(m.weight.numel() * 2 for m in layers)
    assert int8 <= 0.52 * fp16


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "int3"}, r"mode='int3'"),
    ({"mode": None}, r"mode=None"),
    ({"mode": ["w8a16"]}, r"mode=\['w8a16'\]"),
    ({"mode": "bnb-int8", "group_size": 32}, r"group_size=32.*w8a16"),
    ({"group_size": 100}, r"group_size=100 .*in_features=\d+"),
    ({"group_size": 0}, r"group_size=0"),
    ({"group_size": "32"}, r"group_size='32'"),
    ({"mode": "w8a8", "group_size": 32}, r"group_size=32.*w8a16"),
    ({"skip": "lm_head"}, r"skip='lm_head'"),
    ({"skip": None}, r"skip=None"),
])
def test_bad_input_is_refused_and_changes_nothing(shakespeare, kwargs, match):
    model = copy.deepcopy(shakespeare)
    before = state(model)
    with pytest.raises(ValueError, match=match):
        quantize(model, **kwargs)
    assert same_state(before, state(model))


def test_group_size_is_checked_on_every_layer_before_any_changes():
    net = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))  # 32 divides 64, not 48
    before = state(net)
    with pytest.raises(ValueError, match=r"group_size=32 .*1\.in_features=48"):
        quantize(net, "w8a16", group_size=32, skip=())
    assert same_state(before, state(net))


def test_non_2d_weight_is_refused():
    net = small_net()
    net[0].weight = nn.Parameter(torch.randn(32, 64, 1))
    before = state(net)
    with pytest.raises(ValueError, match=r"0\.weight has shape \(32, 64, 1\)"):
        quantize(net, skip=())
    assert same_state(before, state(net))


def test_not_a_model_is_refused():
    with pytest.raises(ValueError, match=r"model: .*dict"):
        quantize({"weight": torch.ones(2, 2)})


@pytest.mark.parametrize("first, second", [("w8a16", "w8a16"), ("w8a16", "w8a8"),
                                           ("w8a8", "w8a16")])
def test_already_quantized_model_is_refused(first, second):
    net = quantize(small_net(), first, skip=())
    before = state(net)
    with pytest.raises(ValueError, match=r"quantized already"):
        quantize(net, second)
    assert same_state(before, state(net))


def test_small_net_with_bias_matches_float():
    net = small_net()
    x = torch.randn(5, 64)
    expected = net(x)
    for mode in ("w8a16", "w8a8"):
        out = quantize(copy.deepcopy(net), mode, skip=())(x)
        assert (out - expected).norm() / expected.norm() < 0.03


# --- the quantized model in the loops and the engine ---------------------------------------

def file_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_quantized_model_same_tokens_in_generate_and_engine(mode):
    before = file_hash(SHAKESPEARE)
    model = quantize(load_model(SHAKESPEARE, dtype=torch.float32, device="cpu"), mode)
    tok = Tokenizer.from_pretrained(SHAKESPEARE)
    prompts = [tok.encode(t) for t in ("ROMEO:\n", "JULIET:\nO ", "KING HENRY:\nNow")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [generate(model, p, params) for p in prompts]
    assert all(len(a) == 24 for a in alone)
    assert alone == [generate(model, p, params) for p in prompts]  # deterministic
    llm = LLM(model, tok, max_num_seqs=2)  # 3 requests, 2 rows: one joins later
    assert [o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False)] == alone
    assert file_hash(SHAKESPEARE) == before


def test_quantized_model_agrees_with_float32_on_text(shakespeare):
    tok = Tokenizer.from_pretrained(SHAKESPEARE)
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n" * 3
    ids = torch.tensor([tok.encode(text)])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        ref = shakespeare(ids, positions)
        for mode, floor in (("w8a16", 0.99), ("w8a8", 0.95)):
            logits = quantize(copy.deepcopy(shakespeare), mode)(ids, positions)
            agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
            assert agree >= floor, mode


# --- bitsandbytes LLM.int8() -----------------------------------------------------------------

def test_bnb_mode_without_bitsandbytes_is_refused_and_changes_nothing(shakespeare, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # import fails
    assert "pip install bitsandbytes" in bnb_missing()
    model = copy.deepcopy(shakespeare)
    before = state(model)
    with pytest.raises(ImportError, match=r"bnb-int8.*pip install bitsandbytes"):
        quantize(model, "bnb-int8")
    assert same_state(before, state(model))


@pytest.mark.skipif(bnb_missing() is not None, reason=str(bnb_missing()))
def test_bnb_int8_swaps_layers_and_agrees_with_float32(shakespeare):
    import bitsandbytes as bnb
    model = quantize(copy.deepcopy(shakespeare), "bnb-int8")
    swapped = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)}
    assert swapped == linear_names(shakespeare) - {"lm_head"}
    assert model.layers[0].mlp.up_proj.weight.dtype == torch.int8
    assert is_quantized(model)
    with pytest.raises(ValueError, match=r"quantized already"):
        quantize(model, "w8a16")
    tok = Tokenizer.from_pretrained(SHAKESPEARE)
    ids = torch.tensor([tok.encode("ROMEO:\nBut soft, what light through yonder window\n" * 3)])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        agree = (model(ids, positions).argmax(-1) == shakespeare(ids, positions).argmax(-1))
    assert agree.float().mean() >= 0.99
    prompts = [tok.encode(t) for t in ("ROMEO:\n", "JULIET:\nO ")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [generate(model, p, params) for p in prompts]
    llm = LLM(model, tok, max_num_seqs=2)
    assert [o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False)] == alone


# --- fbgemm (PyTorch's CPU int8 kernel) -------------------------------------------------------

needs_fbgemm = pytest.mark.skipif(fbgemm_missing() is not None, reason=str(fbgemm_missing()))


@needs_fbgemm
@pytest.mark.parametrize("bias", [True, False])
def test_fbgemm_layer_is_close_and_batch_invariant(bias):
    torch.manual_seed(2)
    linear = nn.Linear(96, 40, bias=bias)
    layer = FbgemmLinear(linear)
    x = torch.randn(2, 9, 96) * torch.logspace(-2, 2, 9)[None, :, None]  # tokens of any size
    with torch.no_grad():
        y = layer(x)
        alone = torch.stack([torch.cat([layer(t[None]) for t in row]) for row in x])
        ref = linear(x)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.equal(y, alone)  # each token is quantized on its own: batch-invariant
    rel = (y - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 0.03  # every token, small or large, gets a fine step
    assert layer.nbytes() == (96 + 4 + 4 * bias) * 40


@needs_fbgemm
def test_fbgemm_mode_swaps_layers_and_keeps_tokens(shakespeare):
    model = quantize(copy.deepcopy(shakespeare), "fbgemm")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "FbgemmLinear" in kinds and is_quantized(model)
    assert type(model.lm_head) is nn.Linear  # skipped by default
    ids = list(range(5, 40))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = generate(model, ids, params)
    assert len(solo) == 12
    out = LLM(model, None, max_num_seqs=3).generate([ids, ids[:10], ids], params,
                                                   use_tqdm=False)
    assert out[0].outputs[0].token_ids == solo and out[2].outputs[0].token_ids == solo


def test_fbgemm_mode_refuses_a_model_off_the_cpu():
    with torch.device("meta"):
        net = small_net()
    before = [type(m) for m in net.modules()]
    with pytest.raises(ValueError, match="fbgemm.*CPU|CPU.*fbgemm|fbgemm"):
        quantize(net, "fbgemm")
    assert [type(m) for m in net.modules()] == before


# --- quantize on load ------------------------------------------------------------------------

@pytest.mark.parametrize("quantization", ["int8", "w8a16", "w8a8"])
def test_load_model_quantizes_on_load_like_quantize(shakespeare, quantization):
    loaded = load_model(SHAKESPEARE, dtype=torch.float32, quantization=quantization)
    expected = quantize(copy.deepcopy(shakespeare), quantization)
    cls = {"w8a8": Int8Int8Linear, "w8a16": Int8Linear,
           "int8": PackedInt8Linear}[quantization]  # int8: chapter 5's fused kernel
    got = {n: m for n, m in loaded.named_modules() if isinstance(m, Int8Linear)}
    want = {n: m for n, m in expected.named_modules() if isinstance(m, Int8Linear)}
    assert got.keys() == want.keys() and len(got) > 0
    assert all(type(m) is cls for m in got.values())
    for name, layer in got.items():
        assert torch.equal(layer.weight, want[name].weight)
        assert torch.equal(layer.scale, want[name].scale)
    assert type(loaded.lm_head) is nn.Linear
    ids = torch.arange(3, 30)[None]
    pos = torch.arange(27)[None]
    with torch.no_grad():
        assert torch.equal(loaded(ids, pos), expected(ids, pos))


@pytest.mark.parametrize("bad", ["int3", "bnb-int8", "fbgemm", "", 8, True, ["int8"]])
def test_load_model_refuses_other_quantizations(bad):
    with pytest.raises(ValueError, match="quantization"):
        load_model(SHAKESPEARE, quantization=bad)


def test_int8_layers_on_meta_refuses_real_tensors_and_other_modes():
    with pytest.raises(ValueError, match="meta"):
        int8_layers_on_meta(small_net(), "w8a16")
    with torch.device("meta"):
        net = small_net()
    with pytest.raises(ValueError, match="quantize-on-load"):
        int8_layers_on_meta(net, "bnb-int8")
    fill = int8_layers_on_meta(net, "w8a16", skip=())
    assert sorted(fill) == ["0.weight", "2.weight"]
    assert all(type(m) is Int8Linear for m in (net[0], net[2]))


# --- perplexity ------------------------------------------------------------------------------

def test_perplexity_matches_a_direct_computation(shakespeare):
    torch.manual_seed(3)
    ids = torch.randint(0, shakespeare.config.vocab_size, (70,))
    window = 32
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, 69, window):
            chunk = ids[start:start + window]
            if len(chunk) < 2:
                continue
            logp = shakespeare(chunk[None], torch.arange(len(chunk))[None]).log_softmax(-1)
            total -= logp[0, :-1].gather(-1, chunk[1:, None]).sum().item()
            count += len(chunk) - 1
    assert perplexity(shakespeare, ids, window) == pytest.approx(math.exp(total / count),
                                                                 rel=1e-5)


@pytest.mark.parametrize("ids, window", [([5], 16), ([], 16), ([1, 2, 3], 1), ([1, 2], "8")])
def test_perplexity_refuses_bad_input(shakespeare, ids, window):
    with pytest.raises(ValueError):
        perplexity(shakespeare, ids, window)


def test_int8_perplexity_is_close_to_float_on_held_out_text(shakespeare):
    from minillm.bench.workloads import heldout_ids, shakespeare_missing
    if shakespeare_missing(SHAKESPEARE):
        pytest.skip(shakespeare_missing(SHAKESPEARE))
    ids = heldout_ids(SHAKESPEARE)[:2048]
    base = perplexity(shakespeare, ids, 256)
    w8a16 = perplexity(quantize(copy.deepcopy(shakespeare), "w8a16"), ids, 256)
    w8a8 = perplexity(quantize(copy.deepcopy(shakespeare), "w8a8"), ids, 256)
    assert abs(w8a16 / base - 1) < 0.001 and abs(w8a8 / base - 1) < 0.005


FAKE_BNB = '''import logging
logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
    "Failed to load CPU gemm_4bit_forward from kernels-community: no kernels")
logging.getLogger("bitsandbytes.cextension").error("a real error still shows")
'''


def test_bitsandbytes_import_logs_never_reach_the_page(tmp_path):
    """bitsandbytes 0.50.2 logs a warning as it loads on CPUs with AVX512-BF16 (an
    optional package is missing); Jupyter printed it under chapter 5's cells. A stand-in
    package logs the same way at import, under Python's last-resort stderr handler as
    in a notebook: the warning is dropped, the error shown, and the level restored."""
    import subprocess
    import sys
    (tmp_path / "bitsandbytes").mkdir()
    (tmp_path / "bitsandbytes" / "__init__.py").write_text(FAKE_BNB)
    code = ("import logging, minillm.quant.int8 as q\n"
            "q.import_bitsandbytes()\n"
            "assert logging.getLogger('bitsandbytes').level == logging.NOTSET\n"
            "assert q.bnb_missing() is None\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "kernels-community" not in result.stderr
    assert "a real error still shows" in result.stderr


# --- the exact float64 path of int8_matmul ----------------------------------------------------

def test_exact_int8_matmul_gives_the_same_sums_and_outputs():
    import minillm.quant.int8 as q
    torch.manual_seed(6)
    a = torch.randint(-127, 128, (9, 1536), dtype=torch.int8)
    b = torch.randint(-127, 128, (1536, 40), dtype=torch.int8)
    layer = Int8Int8Linear.from_linear(nn.Linear(96, 40))
    x = torch.randn(5, 96) * 4
    outside, y = int8_matmul(a, b), layer(x)
    with exact_int8_matmul():
        with exact_int8_matmul():  # blocks nest
            assert q._exact_blocks == 2
        assert q._exact_blocks == 1
        assert torch.equal(int8_matmul(a, b), outside)
        assert torch.equal(layer(x), y)
    assert q._exact_blocks == 0
    with pytest.raises(RuntimeError), exact_int8_matmul():
        raise RuntimeError("an error inside the block")
    assert q._exact_blocks == 0  # closed again


def test_exact_int8_matmul_takes_the_float64_path_on_the_cpu(monkeypatch):
    import minillm.quant.int8 as q
    calls = []
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1) or
                        (a.long() @ b.long()).to(torch.int32))
    monkeypatch.setitem(q._INT_MM_WORKS, "cpu", True)
    a = torch.randint(-127, 128, (3, 64), dtype=torch.int8)
    b = torch.randint(-127, 128, (64, 8), dtype=torch.int8)
    int8_matmul(a, b)
    assert calls == [1]
    with exact_int8_matmul():
        assert torch.equal(int8_matmul(a, b).long(), a.long() @ b.long())
    assert calls == [1]  # not called inside the block


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_refuses_nan_or_inf_weights_and_changes_nothing(bad):
    net = small_net()
    with torch.no_grad():
        net[2].weight[3, 4] = bad
    before = state(net)
    with pytest.raises(ValueError, match=r"2\.weight holds NaN or inf"):
        quantize(net, "w8a16", skip=())
    after = state(net)  # NaN != NaN: compare with equal_nan
    assert after["classes"] == before["classes"]
    for k, v in before["tensors"].items():
        torch.testing.assert_close(after["tensors"][k], v, rtol=0, atol=0, equal_nan=True)


# --- calibration and SmoothQuant --------------------------------------------------------------

def held_out(model_path=SHAKESPEARE, n=300) -> list[int]:
    tok = Tokenizer.from_pretrained(model_path)
    text = ("ROMEO:\nBut soft, what light through yonder window breaks?\n"
            "It is the east, and Juliet is the sun.\n") * 6
    return tok.encode(text)[:n]


def test_activation_absmax_is_the_largest_input_of_each_channel(shakespeare):
    ids = held_out(n=200)
    found = activation_absmax(shakespeare, ids, window=128)
    linears = {n for n, m in shakespeare.named_modules() if isinstance(m, nn.Linear)}
    assert found.keys() == linears
    with torch.no_grad():  # the input of layers.0's q_proj, by hand, window by window
        expected = torch.zeros(shakespeare.config.hidden_size)
        for start in (0, 128):
            chunk = torch.tensor(ids[start:start + 128])[None]
            h = shakespeare.layers[0].input_layernorm(shakespeare.embed_tokens(chunk))
            expected = torch.maximum(expected, h[0].abs().amax(0))
    torch.testing.assert_close(found["layers.0.self_attn.q_proj"], expected)
    assert found["layers.0.mlp.down_proj"].shape == (shakespeare.config.intermediate_size,)
    assert all(not m._forward_pre_hooks for m in shakespeare.modules())  # hooks removed


@pytest.mark.parametrize("ids, window, match", [
    ([5], 16, r"at least 2"), ("ROMEO", 16, r"token ids"), ([1, 2, 3], 1, r"window"),
    ([1, 10**6], 16, r"\[0, 4096\)"),
])
def test_activation_absmax_refuses_bad_input(shakespeare, ids, window, match):
    with pytest.raises(ValueError, match=match):
        activation_absmax(shakespeare, ids, window)
    assert all(not m._forward_pre_hooks for m in shakespeare.modules())


def test_activation_absmax_refuses_a_quantized_model(shakespeare):
    model = quantize(copy.deepcopy(shakespeare), "w8a16")
    with pytest.raises(ValueError, match=r"quantized already.*calibrate the float"):
        activation_absmax(model, held_out(n=40))


def logits(model, ids):
    with torch.no_grad():
        x = torch.tensor(ids)[None]
        return model(x, torch.arange(x.shape[1])[None])


def test_smoothing_leaves_the_float_model_unchanged(shakespeare):
    ids = held_out()
    model = copy.deepcopy(shakespeare)
    act = activation_absmax(model, ids[:150])
    scales = smooth(model, act, alpha=0.5)
    assert len(scales) == 3 * shakespeare.config.num_layers
    before, after = logits(shakespeare, ids), logits(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)  # the fold is exact
    assert torch.equal(after.argmax(-1), before.argmax(-1))
    norm = model.layers[1].input_layernorm.weight  # ... but the weights did change
    assert not torch.allclose(norm, shakespeare.layers[1].input_layernorm.weight)
    s = scales["layers.1.input_layernorm"]
    torch.testing.assert_close(norm * s, shakespeare.layers[1].input_layernorm.weight)
    attn = model.layers[1].self_attn
    torch.testing.assert_close(attn.k_proj.weight / s,
                               shakespeare.layers[1].self_attn.k_proj.weight)
    # up_proj: its columns take post_attention_layernorm's scales, its rows give
    # down_proj's inputs theirs
    up = model.layers[1].mlp.up_proj.weight
    s_in, t = scales["layers.1.post_attention_layernorm"], scales["layers.1.mlp.up_proj"]
    torch.testing.assert_close(up * t[:, None] / s_in,
                               shakespeare.layers[1].mlp.up_proj.weight)
    down = model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(down / t, shakespeare.layers[1].mlp.down_proj.weight)


def test_smoothing_scales_follow_the_formula(shakespeare):
    ids = held_out(n=150)
    act = activation_absmax(shakespeare, ids)
    for alpha in (0.0, 0.5, 1.0):
        model = copy.deepcopy(shakespeare)
        s = smooth(model, act, alpha)["layers.0.input_layernorm"]

        def qkv_columns(m):
            a = m.layers[0].self_attn
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            return w.abs().amax(0)

        w, x = qkv_columns(shakespeare), act["layers.0.self_attn.q_proj"]
        torch.testing.assert_close(s, x.pow(alpha) / w.pow(1 - alpha))
        w_after = qkv_columns(model)
        if alpha == 0.0:  # every weight column's maximum becomes 1
            torch.testing.assert_close(w_after, torch.ones_like(w_after))
        if alpha == 1.0:  # every activation channel's maximum becomes 1
            torch.testing.assert_close(x / s, torch.ones_like(x))
        if alpha == 0.5:  # both get the same channel maxima
            torch.testing.assert_close(x / s, w_after)


def plant_outlier(model, channel: int = 7, factor: float = 40.0):
    """The same float function, with one hidden channel `factor` times larger at the
    inputs of q/k/v and gate/up (the norm weight up, the weight columns down)."""
    with torch.no_grad():
        for block in model.layers:
            for norm, lins in [(block.input_layernorm, [block.self_attn.q_proj,
                                                        block.self_attn.k_proj,
                                                        block.self_attn.v_proj]),
                               (block.post_attention_layernorm, [block.mlp.gate_proj,
                                                                 block.mlp.up_proj])]:
                norm.weight[channel] *= factor
                for m in lins:
                    m.weight[:, channel] /= factor
    return model


def test_smoothquant_lowers_w8a8_error_on_a_planted_outlier_channel(shakespeare):
    ids = held_out()
    planted = plant_outlier(copy.deepcopy(shakespeare))
    ref = logits(shakespeare, ids)
    torch.testing.assert_close(logits(planted, ids), ref, rtol=1e-3, atol=1e-3)

    def w8a8_error(model):
        out = logits(quantize(copy.deepcopy(model), "w8a8"), ids)
        return ((out - ref).norm() / ref.norm()).item()

    plain, outlier = w8a8_error(shakespeare), w8a8_error(planted)
    assert outlier > 2 * plain  # the outlier channel sets every token's step
    smoothed = copy.deepcopy(planted)
    smooth(smoothed, activation_absmax(smoothed, ids[:150]), alpha=0.5)
    fixed = w8a8_error(smoothed)
    assert fixed < outlier / 3
    assert fixed < plain  # better than W8A8 on the model without the outlier


@pytest.mark.parametrize("alpha", [-0.1, 1.5, True, "0.5", None, float("nan")])
def test_smooth_refuses_a_bad_alpha_and_changes_nothing(shakespeare, alpha):
    model = copy.deepcopy(shakespeare)
    act = activation_absmax(model, held_out(n=40))
    before = state(model)
    with pytest.raises(ValueError, match=r"alpha="):
        smooth(model, act, alpha)
    assert same_state(before, state(model))


def test_smooth_refuses_bad_act_max_and_changes_nothing(shakespeare):
    model = copy.deepcopy(shakespeare)
    act = activation_absmax(model, held_out(n=40))
    before = state(model)
    last = f"layers.{shakespeare.config.num_layers - 1}.mlp.down_proj"  # checked last
    bad = [({k: v for k, v in act.items() if k != last}, rf"act_max\['{last}'\]"),
           ({**act, last: act[last][:-1]}, r"give the \d+ finite"),
           ({**act, last: -act[last]}, r"non-negative"),
           ({**act, last: act[last] * float("nan")}, r"finite"),
           ([act], r"act_max: give the dict")]
    for act_max, match in bad:
        with pytest.raises(ValueError, match=match):
            smooth(model, act_max)
        assert same_state(before, state(model))


def test_smooth_refuses_other_models(shakespeare):
    act = activation_absmax(shakespeare, held_out(n=40))
    with pytest.raises(ValueError, match=r"minillm Transformer"):
        smooth(small_net(), {})
    with pytest.raises(ValueError, match=r"quantized already"):
        smooth(quantize(copy.deepcopy(shakespeare), "w8a8"), act)
    with pytest.raises(ValueError, match=r"model: give a torch.nn.Module"):
        smooth("model", act)


# --- llama.cpp's block formats ----------------------------------------------------------------

def format_cases() -> list[torch.Tensor]:
    torch.manual_seed(7)
    ties = torch.tensor([[0.5, -0.5, 2.5, -2.5, 1.5, 0.49999997, -3.0, 3.0] * 4,
                         [1.0] * 32, [-2.0] + [0.0] * 31, [3.0] * 31 + [-3.0]])
    return [torch.randn(16, 256), torch.randn(4, 64) * 1e-4, torch.zeros(3, 32), ties,
            (torch.randint(-8, 8, (8, 64)) * 0.25).float(), torch.randn(2, 3, 96) * 100,
            torch.randn(4, 64).half()]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quantize_writes_llama_cpp_bytes(kind):
    import gguf

    from minillm.model.gguf import BLOCKS
    per_block, nbytes = BLOCKS[kind]
    for w in format_cases():
        ours = gguf_quantize(w, kind)
        theirs = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType[kind])
        assert ours.dtype == torch.uint8
        assert ours.shape == (*w.shape[:-1], w.shape[-1] // per_block * nbytes)
        assert np.array_equal(ours.numpy(), theirs), (kind, tuple(w.shape))


@pytest.mark.parametrize("kind, bound", [("Q8_0", 0.5), ("Q4_0", 1.0), ("Q4_1", 0.5)])
def test_gguf_round_trip_errors_stay_within_a_step(kind, bound):
    torch.manual_seed(8)
    w = torch.randn(32, 128) * torch.logspace(-2, 1, 32)[:, None]
    back = gguf_round_trip(w, kind)
    assert back.shape == w.shape and back.dtype == torch.float32
    blocks, err = w.reshape(-1, 32), (back - w).reshape(-1, 32).abs()
    step = {"Q8_0": blocks.abs().amax(-1) / 127, "Q4_0": blocks.abs().amax(-1) / 8,
            "Q4_1": (blocks.amax(-1) - blocks.amin(-1)) / 15}[kind]
    # Q4_0 puts the largest |x| on q=0 and has only 7 steps on the other side: the
    # far end can be one step off. The float16 scale adds at most 127 (or 15) q
    # times its rounding, 2**-11 of d: under 0.07 of a step
    assert (err.amax(-1) <= step * (bound + 0.07)).all()
    assert (err.amax(-1) > step * bound * 0.5).any()  # the bound is not loose
    assert gguf_round_trip(torch.zeros(2, 32), kind).abs().max() == 0


def test_q4_1_of_q4_1_weights_is_lossless():
    torch.manual_seed(9)
    once = gguf_round_trip(torch.randn(64, 256), "Q4_1")
    assert torch.equal(gguf_round_trip(once, "Q4_1"), once)  # why SmolLM2 is exact
    assert not torch.equal(gguf_round_trip(once, "Q4_0"), once)


@pytest.mark.parametrize("w, kind, match", [
    (torch.randn(4, 32), "Q5_K", r"kind='Q5_K'"),
    (torch.randn(4, 32), None, r"kind=None"),
    (torch.randn(4, 48), "Q8_0", r"multiple of 32.*\(4, 48\)"),
    (torch.ones(4, 32, dtype=torch.int32), "Q4_0", r"float"),
    (torch.empty(0, 32), "Q4_1", r"multiple of 32"),
    ([[1.0] * 32], "Q8_0", r"list"),
    (torch.full((2, 32), float("nan")), "Q8_0", r"NaN or inf"),
])
def test_gguf_quantize_refuses_bad_input(w, kind, match):
    with pytest.raises(ValueError, match=match):
        gguf_quantize(w, kind)
