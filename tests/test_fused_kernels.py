"""Chapter 5, section 14: the fused-kernel layers. PackedInt8Linear computes what
Int8Linear computes (through _weight_int8pack_mm where PyTorch has it); int4_quantize keeps
every weight within half of its group's step; Int4Linear's kernel output equals the matmul
with its dequantized weights, packed or plain; quantize(), load_model(quantization=) and
quantize_head use them and refuse bad input before changing anything; the engine gives the
same tokens with them as eagerly; chapter 7's benchmark runs them in turns."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import minillm.quant.int8 as quant
from minillm.engine import LLM
from minillm.model.loader import load_model
from minillm.perf.mbu import decode_bytes
from minillm.quant.int8 import (Int4Linear, Int8Linear, PackedInt8Linear, fused_kernel,
                           int4_dequantize, int4_quantize, is_quantized, quantize,
                           quantize_head)
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer

torch.set_num_threads(1)
TINY = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY, dtype=torch.float32, device="cpu")


def linear(out_f=64, in_f=128, bias=False, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_int8_equals_the_eager_int8_layer(bias):
    lin = linear(bias=bias)
    packed, eager = PackedInt8Linear.from_linear(lin), Int8Linear.from_linear(lin)
    assert torch.equal(packed.weight, eager.weight) and torch.equal(packed.scale, eager.scale)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 5, 128).to(dtype)
        y = packed(x)
        assert y.dtype == dtype and y.shape == (3, 5, 64)
        ref = eager(x.float())
        assert torch.allclose(y.float(), ref, rtol=0.03, atol=0.03), (y.float() - ref).abs().max()


def test_packed_int8_uses_the_fused_kernel_where_there_is_one(monkeypatch):
    if not fused_kernel("cpu", 8):
        pytest.skip("this torch has no CPU int8pack kernel")
    calls = []
    real = torch.ops.aten._weight_int8pack_mm

    class Spy:
        def __call__(self, *a):
            calls.append(a[1].dtype)
            return real(*a)
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", Spy())
    PackedInt8Linear.from_linear(linear())(torch.randn(2, 128))
    assert calls == [torch.int8]
    # groups have no fused kernel: the eager path
    PackedInt8Linear.from_linear(linear(), group_size=32)(torch.randn(2, 128))
    assert len(calls) == 1


def test_the_packed_scales_follow_a_changed_scale():
    layer = PackedInt8Linear.from_linear(linear())
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    before = layer(x)
    layer.load_float(2 * linear().weight.detach())  # new weights, new scales
    assert torch.allclose(layer(x).float(), 2 * before.float(), rtol=0.03, atol=0.03)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_is_within_half_of_each_groups_step(group_size):
    torch.manual_seed(1)
    w = torch.randn(48, 256) * torch.logspace(-3, 1, 48)[:, None]
    w[3, 5] = 40.0  # an outlier only widens its own group's step
    q, scale, zero = int4_quantize(w, group_size)
    assert q.dtype == torch.uint8 and q.shape == w.shape and int(q.max()) <= 15
    assert scale.shape == zero.shape == (48, 256 // group_size)
    step = scale.float().repeat_interleave(group_size, dim=1)
    error = (int4_dequantize(q, scale, zero) - w).abs()
    assert (error <= step / 2 + 1e-2 * step).all()


@pytest.mark.parametrize("bad, match", [
    (dict(group_size=48), "group_size=48"), (dict(group_size=None), "group_size=None"),
    (dict(w=torch.randn(16, 100)), "in_features"), (dict(w=torch.randn(20, 64)), "16"),
    (dict(w=torch.randn(64)), "2-D")])
def test_int4_refuses_what_its_kernels_cannot_take(bad, match):
    args = dict(w=torch.randn(32, 64), group_size=32) | bad
    with pytest.raises(ValueError, match=match):
        int4_quantize(args["w"], args["group_size"])


@pytest.mark.parametrize("kernel", [True, False])
def test_int4_layer_computes_with_its_dequantized_weights(kernel, monkeypatch):
    if kernel and not fused_kernel("cpu", 4):
        pytest.skip("this torch has no CPU int4pack kernel")
    if not kernel:  # a device without the kernel: plain nibbles, dequantized
        monkeypatch.setattr(quant, "fused_kernel", lambda device, bits: False)
    lin = linear(out_f=96, in_f=256, bias=True)
    layer = Int4Linear.from_linear(lin)
    assert layer.layout == ("cpu" if kernel else "plain")
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (96, 128)
    q, s, z = int4_quantize(lin.weight.detach())
    assert torch.allclose(layer.dequantize(), int4_dequantize(q, s, z), atol=1e-2)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    ref = x.float() @ layer.dequantize().T + lin.bias.detach()
    assert torch.allclose(layer(x).float(), ref, rtol=0.03, atol=0.05)
    assert layer(x.float()).dtype == torch.float32


def test_a_packed_int4_layer_on_another_device_type_says_so():
    if not fused_kernel("cpu", 4):
        pytest.skip("this torch has no CPU int4pack kernel")
    layer = Int4Linear.from_linear(linear())
    layer.layout = "cuda"  # as if packed for CUDA's kernel
    with pytest.raises(RuntimeError, match="packed for cuda"):
        layer(torch.randn(1, 128))


def test_quantize_int4_and_int8_swap_layers_and_refuse_bad_groups_first(tiny):
    model = copy.deepcopy(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for bad in (dict(mode="int4", group_size=48), dict(mode="int8", group_size=32)):
        with pytest.raises(ValueError, match="group_size"):
            quantize(model, **bad)
        assert not is_quantized(model)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    quantize(model, "int4")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Int4Linear" in kinds and is_quantized(model)
    assert isinstance(model.lm_head, nn.Linear)  # skipped by default
    with pytest.raises(ValueError, match="quantized already"):
        quantize(model, "int8")
    quantize_head(model)
    assert isinstance(model.lm_head, PackedInt8Linear)
    with pytest.raises(ValueError, match="lm_head"):
        quantize_head(model)


def test_the_head_in_int4_and_a_bad_mode(tiny):
    model = copy.deepcopy(tiny).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"mode='int2': allowed 'int8' and 'int4'"):
        quantize_head(model, "int2")
    assert isinstance(model.lm_head, nn.Linear)  # refused before any change
    ids = torch.tensor([[3, 7, 11, 2]])
    positions = torch.arange(4)[None]
    with torch.no_grad():
        before = model(ids, positions)
        quantize_head(model, "int4")
        after = model(ids, positions)
    assert isinstance(model.lm_head, Int4Linear)
    assert model.lm_head.weight.nbytes < model.embed_tokens.weight.nbytes / 3
    assert 0 < (after - before).abs().max() < 0.2 * before.abs().max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_on_load_gives_the_same_layers_as_quantize(tiny, mode):
    loaded = load_model(TINY, dtype=torch.bfloat16, quantization=mode)
    swapped = quantize(copy.deepcopy(tiny), mode)  # from the same float32 weights
    cls = {"int8": PackedInt8Linear, "int4": Int4Linear}[mode]
    names = [n for n, m in swapped.named_modules() if isinstance(m, cls)]
    assert names and names == [n for n, m in loaded.named_modules() if isinstance(m, cls)]
    for n in names:
        a, b = loaded.get_submodule(n), swapped.get_submodule(n)
        assert torch.equal(a.weight, b.weight)
        if mode == "int4":
            assert a.scale_zero.dtype == torch.bfloat16  # not the model's dtype
            assert torch.equal(a.scale_zero, b.scale_zero)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_engine_gives_the_same_tokens_as_the_model_eagerly(tiny, mode):
    """The fused layers are plain modules: the engine and a full forward agree."""
    model = quantize_head(quantize(copy.deepcopy(tiny).to(torch.bfloat16), mode))
    tok = Tokenizer.from_pretrained(TINY)
    prompt = tok.encode("ROMEO: What light")
    out = LLM(model, tok, max_num_seqs=2, max_model_len=128).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            t = torch.tensor([ids])
            ids.append(int(model(t, torch.arange(len(ids))[None])[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_decode_bytes_counts_one_embedding_row_once_the_head_is_its_own(tiny):
    tied = copy.deepcopy(tiny)
    tied.lm_head.weight = tied.embed_tokens.weight
    emb = tied.embed_tokens.weight
    full = decode_bytes(tied)
    split = decode_bytes(quantize_head(tied))
    head = tied.lm_head.weight.nbytes + tied.lm_head.scale.nbytes
    assert split == full - emb.nbytes + emb[0].nbytes + head


def test_the_decode_benchmark_runs_the_fast_modes_in_turns():
    from minillm.bench.decode import run_perf_benchmark
    from minillm.bench.measure import fast_copy
    with pytest.raises(ValueError, match="fast="):
        run_perf_benchmark("bundled", "cpu", fast=("int3",))
    rows = run_perf_benchmark("bundled", "cpu", prompt_tokens=8, new_tokens=4,
                              repeats=1, fast=("int8", "int4")).rows
    ways = [r["way"] for r in rows]
    assert "engine, bfloat16 (ch. 5)" in ways
    assert "engine, int4 + int8 head, bfloat16 (ch. 5)" in ways
    # MBU x time = the bytes a step reads, each way with its own model's bytes
    read = {r["way"]: r["MBU"] * r["ms_per_token"] for r in rows if r["batch"] == 1}
    assert read["engine, bfloat16 (ch. 5)"] < 0.55 * read["engine (ch. 4, 6)"]
    assert (read["engine, int4 + int8 head, bfloat16 (ch. 5)"]
            < read["engine, int8 + int8 head, bfloat16 (ch. 5)"]
            < read["engine, bfloat16 (ch. 5)"])
    fast = fast_copy(load_model(TINY), "int4")
    assert isinstance(fast.lm_head, PackedInt8Linear)
    assert fast.norm.weight.dtype == torch.bfloat16


def test_the_serving_benchmark_serves_the_same_work_with_the_fast_modes():
    from minillm.bench.serving import run_serving_benchmark
    result = run_serving_benchmark(TINY, num_requests=4, max_num_seqs=4,
                                   methods=("minillm-continuous", "minillm-int8",
                                            "minillm-int4"),
                                   prompt_tokens=(8, 16), output_tokens=(4, 8),
                                   prompts="random", progress=False)
    rows = {r["method"]: r for r in result.rows}
    assert set(rows) == {"minillm continuous",
                         "minillm continuous, int8 + int8 head, bfloat16",
                         "minillm continuous, int4 + int8 head, bfloat16"}
    useful = {r["useful_tokens"] for r in rows.values()}
    assert len(useful) == 1 and useful.pop() > 0  # every request ran to its length
    assert rows["minillm continuous"]["same_tokens"] is True
