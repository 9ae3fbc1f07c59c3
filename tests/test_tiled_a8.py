"""minillm.quant.tiled_a8 (chapter 7's appendix, §7): chapter 5's int4 codes, and §6's int8
weights in blocks of 32, in tiles of 16 outputs, times activations quantized to int8 in
blocks of 32. The C++ kernel (AVX-512 VNNI) gives the PyTorch maths' answer (§6's
blockwise_linear for int8), a row's bits do not depend on the rows beside it, the layers
hold chapter 5's weights, and the modes "int4-a8" and "int8-a8-tiles" are registered for
quantize, load_model, the fused projections and the compiled engine."""
import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import minillm.quant.tiled_a8 as tiled_a8
from minillm.engine import LLMEngine
from minillm.quant.fused import stack_rows
from minillm.model.loader import load_model
from minillm.quant.int8 import Int4Linear, int4_dequantize, int4_quantize, quantize
from minillm.sampling import SamplingParams
from minillm.utils import bundled_model_path
from minillm.quant.tiled_a8 import (Int4A8Linear, Int8A8Tiles, tile_int4, tile_int8,
                              tile_scale_zero, tile_scales, tiled_a8_in_pytorch,
                              untile_int4, untile_scale_zero)
from minillm.quant.w8a8_cpu import Int8A8Linear, blockwise_linear, quantized_blocks
from helpers import kernel_fixture

torch.set_num_threads(2)


kernel_loaded = kernel_fixture(tiled_a8)  # built when the first test runs


def vnni() -> bool:
    return tiled_a8.kernel().has_vnni()


w4a8 = tiled = torch.ops.minillm.tiled_a8_linear


def int4_weights(N, K, group, seed=0):
    """Chapter 5's int4 codes of a random weight, its scale_zero [groups, N, 2], and
    both tiled."""
    g = torch.Generator().manual_seed(seed)
    codes, scale, zero = int4_quantize(torch.randn(N, K, generator=g) / 20, group)
    sz = torch.stack([scale.T, zero.T], -1)
    return codes, sz, tile_int4(codes).view(N, -1), tile_scale_zero(sz)


def test_tiles_put_16_outputs_in_a_load_and_come_back():
    codes = torch.randint(0, 16, (32, 24), dtype=torch.uint8)
    tiles = tile_int4(codes)
    assert tiles.shape == (2, 3, 16, 4) and tiles.dtype == torch.uint8
    # tile 1, chunk 2, output 16 + 5, byte 3: inputs 16 + 3 (low) and 16 + 7 (high)
    assert tiles[1, 2, 5, 3] == codes[21, 19] | codes[21, 23] << 4
    assert torch.equal(untile_int4(tiles), codes)
    sz = torch.randn(3, 32, 2)  # [groups, N, 2]: tile 1, group 2, output 16 + 5
    assert torch.equal(tile_scale_zero(sz)[1, 2, 5], sz[2, 21])
    assert torch.equal(untile_scale_zero(tile_scale_zero(sz)), sz)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("N,K", [(16, 128), (48, 256), (96, 384)])
@pytest.mark.parametrize("M", [1, 3, 4, 5, 33])
def test_the_operator_gives_the_pytorch_maths(M, N, K, group):
    if K % group:
        pytest.skip("int4 needs K divisible by the group size")
    codes, plain, tiles, sz = int4_weights(N, K, group, seed=M)
    x = torch.randn(M, K) * torch.rand(M, K) * 4
    x[0, :32] = 0.0  # a block of zeros: scale 0, codes 0
    weights = int4_dequantize(codes, plain[..., 0].T, plain[..., 1].T)
    want = quantized_blocks(x) @ weights.t()
    assert torch.allclose(w4a8(x, tiles, sz, group), want, rtol=1e-4, atol=1e-4)
    assert torch.allclose(tiled_a8_in_pytorch(x, tiles, sz, group), want, rtol=1e-5,
                          atol=1e-5 * want.abs().max())
    assert w4a8(x.bfloat16(), tiles, sz, group).dtype == torch.bfloat16
    assert torch.allclose(w4a8(x, tiles, sz.float(), group), w4a8(x, tiles, sz, group))


def test_a_row_gives_the_same_bits_alone_or_in_a_batch():
    *_, tiles, sz = int4_weights(96, 256, 64)
    x = torch.randn(37, 256)
    batch = w4a8(x, tiles, sz, 64)
    assert all(torch.equal(w4a8(x[i:i + 1], tiles, sz, 64), batch[i:i + 1])
               for i in range(37))


def test_the_kernel_refuses_shapes_it_cannot_tile():
    if not vnni():
        pytest.skip("this CPU has no AVX-512 VNNI")
    *_, tiles, sz = int4_weights(16, 64, 32)
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        w4a8(torch.randn(1, 64), tiles[:8], sz, 32)
    with pytest.raises(RuntimeError, match=r"\[N/16, K/G, 16, 2\], G a multiple of 32"):
        w4a8(torch.randn(1, 64), tiles, sz, 64)


def test_the_layer_holds_chapter_5s_int4_weights():
    linear = nn.Linear(256, 48)
    ours, int4 = (mode.from_linear(linear) for mode in (Int4A8Linear, Int4Linear))
    assert ours.weight.shape == int4.weight.shape  # [N, K/2] bytes, in tiles
    assert torch.equal(untile_scale_zero(ours.scale_zero), int4.scale_zero)
    same = int4_dequantize(*int4_quantize(linear.weight.detach(), 32))
    assert torch.equal(ours.dequantize(), same)  # the weights chapter 5's codes mean
    x = torch.randn(3, 256)
    want = quantized_blocks(x) @ ours.dequantize().t() + linear.bias
    assert torch.allclose(ours(x), want, rtol=1e-4, atol=1e-4)
    assert "tiles of 16" in repr(ours)


def test_quantize_swaps_every_linear_but_the_head():
    m = load_model(bundled_model_path(), dtype=torch.float32)
    quantize(m, "int4-a8", group_size=64)
    kinds = {type(mod).__name__ for name, mod in m.named_modules()
             if name.endswith("_proj")}
    assert kinds == {"Int4A8Linear"} and isinstance(m.lm_head, nn.Linear)
    assert m.layers[0].mlp.down_proj.group_size == 64


def test_quantize_refuses_what_the_kernel_cannot_take_before_changing_anything():
    m = nn.Sequential(nn.Linear(64, 16), nn.Linear(64, 8))
    with pytest.raises(ValueError, match=r"1: in_features=64, out_features=8; mode "
                                         r"'int4-a8' needs in_features divisible by 32 "
                                         r"and out_features by 16"):
        quantize(m, "int4-a8", skip=())
    assert all(type(layer) is nn.Linear for layer in m)
    with pytest.raises(ValueError, match=r"group_size=48; mode 'int4-a8' takes one of"):
        quantize(nn.Sequential(nn.Linear(96, 16)), "int4-a8", group_size=48, skip=())


def test_load_model_quantizes_on_load_to_the_same_layers():
    loaded = load_model(bundled_model_path(), quantization="int4-a8")
    swapped = quantize(load_model(bundled_model_path()), "int4-a8")
    a, b = loaded.layers[2].self_attn.q_proj, swapped.layers[2].self_attn.q_proj
    assert type(a) is Int4A8Linear and torch.equal(a.weight, b.weight)
    assert torch.equal(a.scale_zero, b.scale_zero) and a.scale_zero.shape == (
        a.out_features // 16, a.in_features // 32, 16, 2)


def test_the_mode_is_registered_in_one_place_for_a_fresh_process():
    code = ("import sys, torch.nn as nn\nfrom minillm.quant.int8 import quantize\n"
            "m = quantize(nn.Sequential(nn.Linear(64, 16)), 'int4-a8', skip=())\n"
            "print(type(m[0]).__name__, 'minillm.quant.tiled_a8' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["Int4A8Linear", "True"]


def test_an_int8_tile_layer_alone_loads_the_kernel():
    """Int8A8Tiles made first in a process (mode 'int8-a8-tiles', or a head before any
    int4 layer) runs the C++ kernel, not the operator's PyTorch fallback."""
    code = ("import torch, torch.nn as nn\n"
            "from minillm.quant.tiled_a8 import Int8A8Tiles\n"
            "Int8A8Tiles.from_linear(nn.Linear(64, 16, bias=False))\n"
            "print(torch._C._dispatch_has_kernel_for_dispatch_key("
            "'minillm::tiled_a8_linear', 'CPU'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split()[-1] == "True"


def test_stacked_layers_give_the_separate_outputs_bit_for_bit():
    parts = [Int4A8Linear.from_linear(nn.Linear(128, n, bias=False)) for n in (32, 16, 16)]
    fused = stack_rows(parts)
    x = torch.randn(3, 128)
    assert type(fused) is Int4A8Linear and fused.out_features == 64
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], -1))


def test_the_compiled_engine_calls_the_operator_in_its_step():
    model = load_model(bundled_model_path(), dtype=torch.float32, quantization="int4-a8")
    engine = LLMEngine(model, max_num_seqs=2, kv_cache="paged", max_model_len=128,
                       compile_decode=True, fuse_projections=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    rid = engine.add_request(list(range(10, 30)), params)
    engine.step()  # the prompt, eager
    engine.step()  # the first decode step compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        engine.step()  # one compiled decode step
    calls = [e for e in p.events() if e.name == "minillm::tiled_a8_linear"]
    assert len(calls) == 4 * len(model.layers) + 1  # q/k/v, o, gate/up, down; the head
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop(rid).output_ids) == 6


def test_the_benchmarks_run_the_mode_in_float32_with_an_int8_a8_head_in_blocks():
    from minillm.bench.measure import FAST_MODES, fast_copy
    fast = fast_copy(load_model(bundled_model_path()), "int4-a8")
    assert type(fast.layers[0].mlp.up_proj) is Int4A8Linear
    assert type(fast.lm_head) is Int8A8Tiles  # 8 bits, blocks of 32: as Q8_0
    assert fast.norm.weight.dtype == torch.float32
    assert FAST_MODES["int4-a8"].label("int4-a8") == "int4-a8 + int8-a8-tiles head"


def test_the_loaded_mode_brings_the_benchmarks_head():
    """load_model(quantization="int4-a8") is fast_copy(model, "int4-a8") bit for bit:
    its head in int8-a8-tiles, read from the tied embedding, which stays float."""
    from minillm.bench.measure import fast_copy
    loaded = load_model(bundled_model_path(), dtype=torch.float32, quantization="int4-a8")
    fast = fast_copy(load_model(bundled_model_path(), dtype=torch.float32), "int4-a8")
    assert type(loaded.lm_head) is Int8A8Tiles
    assert loaded.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(loaded.embed_tokens.weight, fast.embed_tokens.weight)
    ids = torch.randint(0, loaded.config.vocab_size, (2, 9))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        assert torch.equal(loaded(ids, positions), fast(ids, positions))


def test_a_model_in_the_mode_stays_close_to_chapter_5s_int4():
    model = load_model(bundled_model_path(), dtype=torch.float32)
    int4 = quantize(copy.deepcopy(model), "int4")
    ours = quantize(copy.deepcopy(model), "int4-a8")
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    positions = torch.arange(24)[None].expand(2, -1)
    with torch.no_grad():
        a, b, ref = (m(ids, positions).float() for m in (ours, int4, model))
    # 8-bit activations add little to 4-bit weights' error
    assert (a - ref).pow(2).mean() < 1.5 * (b - ref).pow(2).mean()


@pytest.mark.parametrize("N,K", [(16, 64), (48, 192), (96, 576)])
@pytest.mark.parametrize("M", [1, 3, 4, 5, 33])
def test_int8_tiles_give_blockwise_linear(M, N, K):
    g = torch.Generator().manual_seed(M)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scale = torch.rand(N, K // 32, generator=g) / 100  # a scale per 32 weights
    x = torch.randn(M, K) * torch.rand(M, K) * 4
    x[0, :32] = 0.0
    want = blockwise_linear(x, w, scale)
    tiles, scales = tile_int8(w).view(N, K), tile_scales(scale)
    assert torch.allclose(tiled(x, tiles, scales, 32), want, rtol=1e-4, atol=1e-5)
    assert torch.allclose(tiled_a8_in_pytorch(x, tiles, scales, 32), want, rtol=1e-4,
                          atol=1e-5 * want.abs().max())
    batch = tiled(x, tiles, scales, 32)
    assert all(torch.equal(tiled(x[i:i + 1], tiles, scales, 32), batch[i:i + 1])
               for i in range(M))


def test_the_int8_tile_layer_is_section_6s_layer_in_blocks_of_32():
    linear = nn.Linear(192, 48)
    ours = Int8A8Tiles.from_linear(linear)
    rows = Int8A8Linear.from_linear(linear, 32)
    assert ours.group_size == 32 and ours.scale.shape == (3, 6, 16)
    assert torch.equal(ours.weight, tile_int8(rows.weight).view(48, 192))
    x = torch.randn(5, 192)
    assert torch.allclose(ours(x), rows(x), rtol=1e-4, atol=1e-5)
    loaded = load_model(bundled_model_path(), quantization="int8-a8-tiles")
    swapped = quantize(load_model(bundled_model_path()), "int8-a8-tiles")
    a, b = loaded.layers[1].mlp.gate_proj, swapped.layers[1].mlp.gate_proj
    assert type(a) is Int8A8Tiles and torch.equal(a.weight, b.weight)
    assert torch.equal(a.scale, b.scale)
    with pytest.raises(ValueError, match=r"group_size=64; mode 'int8-a8-tiles' takes "
                                         r"one of \(None, 32\)"):
        quantize(nn.Sequential(nn.Linear(64, 16)), "int8-a8-tiles", group_size=64,
                 skip=())
    parts = [Int8A8Tiles.from_linear(nn.Linear(64, n, bias=False)) for n in (32, 16)]
    assert torch.equal(stack_rows(parts)(x[:, :64]),
                       torch.cat([p(x[:, :64]) for p in parts], -1))
