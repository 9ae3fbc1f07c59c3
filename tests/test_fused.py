"""Chapter 7's appendix, section 4: q/k/v and gate/up stacked into one matmul each
(`fuse_projections`, `LLMEngine(..., fuse_projections=True)`)."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import FAMILIES, make_hf_model
from minillm.engine import LLMEngine
from minillm.quant.fused import FusedAttention, FusedMLP, fuse_projections, stack_rows
from minillm.invariant.ops import make_batch_invariant
from minillm.model.loader import load_model
from minillm.model.transformer import Attention
from minillm.quant.int8 import quantize
from minillm.sampling import SamplingParams
from minillm.utils import bundled_model_path

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bundled():
    return load_model(bundled_model_path(), dtype=torch.float32)


def logits(model, ids):
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions)


def linear_calls(model) -> int:
    """How many linear layers one token's forward calls."""
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1))
             for m in model.modules() if hasattr(m, "in_features")]
    logits(model, torch.tensor([[5]]))
    for h in hooks:
        h.remove()
    return len(calls)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gives_the_same_logits_fused(family, tmp_path):
    make_hf_model(tmp_path, family, "random_norms")  # biases, qk norms, tied heads
    model = load_model(tmp_path, device="cpu")
    fused = fuse_projections(copy.deepcopy(model))
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    assert torch.equal(logits(model, ids), logits(fused, ids))  # the same dot products
    L = model.config.num_layers
    assert linear_calls(model) == 7 * L + 1 and linear_calls(fused) == 4 * L + 1
    assert sum(p.numel() for p in fused.parameters()) == \
        sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mode, group_size, dtype", [
    ("w8a16", None, torch.float32), ("w8a16", 32, torch.float32),
    ("w8a8", None, torch.float32), ("int8", None, torch.bfloat16),
    ("int4", 32, torch.bfloat16)])
def test_quantized_layers_stack_as_they_are(bundled, mode, group_size, dtype):
    plain = quantize(copy.deepcopy(bundled).to(dtype), mode, group_size)
    fused = fuse_projections(copy.deepcopy(plain))
    qkv = fused.layers[0].self_attn.qkv_proj
    assert type(qkv) is type(plain.layers[0].self_attn.q_proj)  # still quantized
    attn = plain.layers[0].self_attn
    assert torch.equal(qkv.weight, torch.cat(
        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    ids = torch.randint(0, bundled.config.vocab_size, (2, 12))
    assert torch.equal(logits(plain, ids), logits(fused, ids))


def test_the_engine_option_gives_the_same_tokens(bundled):
    outs = {}
    for fuse in (False, True):
        model = copy.deepcopy(bundled)
        engine = LLMEngine(model, max_num_seqs=3, kv_cache="paged",
                           fuse_projections=fuse)
        assert isinstance(model.layers[0].self_attn, FusedAttention) == fuse
        rids = [engine.add_request(list(range(50, 60 + 3 * i)), SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True)) for i in range(4)]
        while engine.has_unfinished():
            engine.step()
        outs[fuse] = [engine.pop(r).output_ids for r in rids]
    assert outs[True] == outs[False]


def test_fusing_twice_changes_nothing(bundled):
    fused = fuse_projections(copy.deepcopy(bundled))
    layer = fused.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    fuse_projections(fused)
    assert layer.self_attn is attn and layer.mlp is mlp


def test_fused_layers_keep_the_other_parts(bundled):
    model = copy.deepcopy(bundled)
    o_proj, down = model.layers[1].self_attn.o_proj, model.layers[1].mlp.down_proj
    fuse_projections(model)
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert isinstance(attn, Attention) and isinstance(mlp, FusedMLP)
    assert attn.o_proj is o_proj and mlp.down_proj is down and attn.layer_idx == 1
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
    assert attn.sizes == [o_proj.in_features, *[bundled.config.num_kv_heads
                                                 * bundled.config.head_dim] * 2]


@pytest.mark.parametrize("bad", [1, "yes", 0.0])
def test_bad_option_values_are_refused(bundled, bad):
    model = copy.deepcopy(bundled)
    with pytest.raises(ValueError, match=f"fuse_projections={bad!r}: must be True"):
        LLMEngine(model, fuse_projections=bad)
    assert isinstance(model.layers[0].self_attn, Attention)
    assert hasattr(model.layers[0].self_attn, "q_proj")  # untouched


def test_wrapped_attention_is_refused_before_any_swap(bundled):
    model = make_batch_invariant(copy.deepcopy(bundled))
    before = [type(layer.self_attn) for layer in model.layers]
    with pytest.raises(TypeError, match="layers.0 holds FixedOrderAttention and MLP"):
        fuse_projections(model)
    assert [type(layer.self_attn) for layer in model.layers] == before


def test_a_layer_that_cannot_stack_is_named(bundled):
    model = copy.deepcopy(bundled)
    last = model.layers[-1].mlp
    last.up_proj = torch.nn.Identity()
    last.up_proj.in_features = last.gate_proj.in_features  # looks like a layer
    n = len(model.layers) - 1
    with pytest.raises(TypeError, match=f"layers.{n}: layers of different kinds"):
        fuse_projections(model)
    assert not isinstance(model.layers[0].self_attn, FusedAttention)  # none swapped
    with pytest.raises(TypeError, match="Identity layers cannot be stacked"):
        stack_rows([torch.nn.Identity()])


def test_fused_then_batch_invariant_gives_the_same_tokens(bundled):
    outs = {}
    for fuse in (False, True):
        engine = LLMEngine(copy.deepcopy(bundled), max_num_seqs=2, kv_cache="paged",
                           batch_invariant=True, fuse_projections=fuse)
        rid = engine.add_request(list(range(70, 90)), SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        outs[fuse] = engine.pop(rid).output_ids
    assert outs[True] == outs[False]
