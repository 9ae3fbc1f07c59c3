"""minillm.quant.w8a8_cpu (chapter 7's appendix, §6): int8 weights times activations quantized
to int8 in blocks of 32. The C++ kernel (AVX-512 VNNI) gives blockwise_linear's answer,
a row's bits do not depend on the rows beside it, the operator computes the same maths
without VNNI, and the mode "int8-a8" is registered for quantize, load_model, the fused
projections and the compiled engine."""
import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import minillm.quant.w8a8_cpu as w8a8_cpu
from minillm.engine import LLMEngine
from minillm.quant.fused import stack_rows
from minillm.model.loader import load_model
from minillm.quant.int8 import quantize
from minillm.sampling import SamplingParams
from minillm.utils import bundled_model_path
from minillm.quant.w8a8_cpu import Int8A8Linear, blockwise_linear, folded_blocks
from helpers import kernel_fixture

torch.set_num_threads(2)


kernel_loaded = kernel_fixture(w8a8_cpu)  # built when the first test runs


def vnni() -> bool:
    return w8a8_cpu.kernel().has_vnni()


a8 = torch.ops.minillm.int8_a8_linear


def weights(N, K, seed=0, blocks=False):
    """int8 weights and their scales: one per output [N], or one per 32 [N, K/32]."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    return w, torch.rand((N, K // 32) if blocks else N, generator=g) / 100


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("N,K", [(24, 64), (17, 192), (40, 128)])
@pytest.mark.parametrize("M", [1, 3, 4, 5, 33])
def test_the_operator_gives_blockwise_linear(M, N, K, blocks):
    w, scale = weights(N, K, seed=M, blocks=blocks)
    x = torch.randn(M, K) * torch.rand(M, K) * 4
    x[0, :32] = 0.0  # a block of zeros: scale 0, codes 0
    want = blockwise_linear(x, w, scale)
    assert torch.allclose(a8(x, w, scale), want, rtol=1e-4, atol=1e-5)
    assert a8(x.bfloat16(), w, scale).dtype == torch.bfloat16


def test_blockwise_linear_gives_each_block_its_own_scale():
    w, scale = weights(64, 256)
    x = torch.randn(1, 256)
    x[0, 3] = 200.0  # an outlier in the first block coarsens only that block
    exact = x @ (w.float() * scale[:, None]).t()
    blocks = blockwise_linear(x, w, scale)
    per_row = blockwise_linear(x, w, scale, block=256)  # one scale for the row
    # errors: 32 coarse codes against 256 (about sqrt(1/8) as large)
    assert (blocks - exact).abs().mean() < 0.6 * (per_row - exact).abs().mean()


@pytest.mark.parametrize("blocks", [False, True])
def test_a_row_gives_the_same_bits_alone_or_in_a_batch(blocks):
    w, scale = weights(96, 256, blocks=blocks)
    x = torch.randn(37, 256).bfloat16()
    batch = a8(x, w, scale)
    assert all(torch.equal(a8(x[i:i + 1], w, scale), batch[i:i + 1]) for i in range(37))


@pytest.mark.parametrize("blocks", [False, True])
def test_the_pytorch_version_for_cpus_without_vnni_computes_the_same_maths(blocks):
    w, scale = weights(40, 192, blocks=blocks)
    x = torch.randn(5, 192)
    want = blockwise_linear(x, w, scale)
    assert torch.allclose(folded_blocks(x, w, scale), want, rtol=1e-4, atol=1e-5)
    assert torch.allclose(a8(x, w, scale), folded_blocks(x, w, scale), rtol=1e-4,
                          atol=1e-5)


def test_the_kernel_refuses_a_row_length_it_cannot_load_whole():
    if not vnni():
        pytest.skip("this CPU has no AVX-512 VNNI")
    w, scale = weights(8, 96)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        a8(torch.randn(1, 96), w, scale)


def test_quantize_swaps_every_linear_but_the_head():
    m = load_model(bundled_model_path(), dtype=torch.float32)
    quantize(m, "int8-a8")
    kinds = {type(mod).__name__ for name, mod in m.named_modules()
             if name.endswith("_proj")}
    assert kinds == {"Int8A8Linear"} and isinstance(m.lm_head, nn.Linear)
    x = torch.randn(2, 5, 256)
    layer = m.layers[0].mlp.down_proj
    rows = x.reshape(-1, 256) @ torch.randn(256, 704)
    assert torch.allclose(layer(rows), blockwise_linear(rows, layer.weight,
                                                       layer.scale.view(-1)),
                          rtol=1e-4, atol=1e-4)


def test_quantize_refuses_what_the_kernel_cannot_take_before_changing_anything():
    m = nn.Sequential(nn.Linear(64, 8), nn.Linear(96, 8))
    with pytest.raises(ValueError, match=r"1: in_features=96; mode 'int8-a8' needs a "
                                         r"multiple of 64"):
        quantize(m, "int8-a8", skip=())
    assert all(type(layer) is nn.Linear for layer in m)
    with pytest.raises(ValueError, match="group_size=64; mode 'int8-a8' takes None"):
        quantize(nn.Sequential(nn.Linear(64, 8)), "int8-a8", group_size=64, skip=())


def test_load_model_quantizes_on_load_to_the_same_layers():
    loaded = load_model(bundled_model_path(), quantization="int8-a8")
    swapped = quantize(load_model(bundled_model_path()), "int8-a8")
    a, b = loaded.layers[2].self_attn.q_proj, swapped.layers[2].self_attn.q_proj
    assert type(a) is Int8A8Linear and torch.equal(a.weight, b.weight)
    assert torch.equal(a.scale, b.scale)


def test_the_loaded_mode_brings_its_head_in_blocks_of_32():
    """The head, a fifth of SmolLM2's weights, is the mode's too (as fast_copy makes
    it for the benchmarks): int8-a8 in blocks of 32, read from the tied embedding,
    which stays float and is no longer shared."""
    from minillm.bench.measure import fast_copy
    loaded = load_model(bundled_model_path(), dtype=torch.float32, quantization="int8-a8")
    fast = fast_copy(load_model(bundled_model_path(), dtype=torch.float32), "int8-a8")
    assert type(loaded.lm_head) is Int8A8Linear and loaded.lm_head.group_size == 32
    assert loaded.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, fast.lm_head.weight)
    assert torch.equal(loaded.lm_head.scale, fast.lm_head.scale)
    float32 = load_model(bundled_model_path(), dtype=torch.float32)
    assert torch.equal(loaded.embed_tokens.weight, float32.embed_tokens.weight)


def test_the_mode_is_registered_in_one_place_for_a_fresh_process():
    code = ("import sys, torch.nn as nn\nfrom minillm.quant.int8 import quantize\n"
            "m = quantize(nn.Sequential(nn.Linear(64, 8)), 'int8-a8', skip=())\n"
            "print(type(m[0]).__name__, 'minillm.quant.w8a8_cpu' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["Int8A8Linear", "True"]


def test_stacked_layers_give_the_separate_outputs_bit_for_bit():
    parts = [Int8A8Linear.from_linear(nn.Linear(128, n, bias=False)) for n in (24, 8, 8)]
    fused = stack_rows(parts)
    x = torch.randn(3, 128).bfloat16()
    assert type(fused) is Int8A8Linear
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], -1))


def test_the_compiled_engine_calls_the_operator_in_its_step():
    model = load_model(bundled_model_path(), dtype=torch.bfloat16, quantization="int8-a8")
    engine = LLMEngine(model, max_num_seqs=2, kv_cache="paged", max_model_len=128,
                       compile_decode=True, fuse_projections=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    rid = engine.add_request(list(range(10, 30)), params)
    engine.step()  # the prompt, eager
    engine.step()  # the first decode step compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        engine.step()  # one compiled decode step
    calls = [e for e in p.events() if e.name == "minillm::int8_a8_linear"]
    assert len(calls) == 4 * len(model.layers) + 1  # q/k/v, o, gate/up, down; the head
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop(rid).output_ids) == 6


def test_weights_in_blocks_of_32_are_more_exact_through_the_same_kernel():
    torch.manual_seed(0)
    linear = nn.Linear(192, 48, bias=False)
    with torch.no_grad():
        linear.weight[:, 7] *= 30  # an outlier column coarsens a whole row's scale
    rows, blocks = (quantize(nn.Sequential(copy.deepcopy(linear)), "int8-a8",
                             group_size=g, skip=())[0] for g in (None, 32))
    assert rows.scale.shape == (48, 1) and blocks.scale.shape == (48, 6)
    x = torch.randn(3, 192)
    exact = linear(x)
    assert torch.allclose(blocks(x), blockwise_linear(x, blocks.weight, blocks.scale),
                          rtol=1e-4, atol=1e-5)
    error = {name: (layer(x) - exact).pow(2).mean() for name, layer in
             (("rows", rows), ("blocks", blocks))}
    assert error["blocks"] < 0.5 * error["rows"]


def test_the_benchmarks_run_the_mode_in_float32_with_its_head_in_blocks():
    from minillm.bench.measure import FAST_MODES, fast_copy
    model = load_model(bundled_model_path())
    fast = fast_copy(model, "int8-a8")
    head = fast.lm_head
    assert isinstance(head, Int8A8Linear) and head.group_size == 32  # as Q8_0's
    assert head.scale.shape == (head.out_features, head.in_features // 32)
    assert fast.norm.weight.dtype == torch.float32  # no casts around the kernel
    assert FAST_MODES["int8-a8"].label("int8-a8") == (
        "int8-a8 + int8-a8 head in blocks of 32")
    int8 = fast_copy(model, "int8")  # chapter 5's modes as before
    assert int8.norm.weight.dtype == torch.bfloat16
    assert type(int8.lm_head).__name__ == "PackedInt8Linear"
    assert FAST_MODES["int8"].label("int8") == "int8 + int8 head"
