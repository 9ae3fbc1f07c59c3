"""The GPU paths of the engine, against their CPU results. Marked `cuda`: skipped on a
machine without a CUDA GPU; tools/gpu_check.sh runs them on one."""
import pytest
import torch

from helpers import drive, greedy
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.model.loader import load_model
from minillm.quant.int8 import int8_matmul, quantize
from minillm.utils import bundled_model_path

pytestmark = pytest.mark.cuda
PROMPTS = [[4093, 40 + i, 300 + 7 * i, 12] for i in range(6)]
PARAMS = greedy(24, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    path = bundled_model_path()
    return load_model(path, dtype=torch.float32), load_model(path, dtype=torch.float32,
                                                             device="cuda")


def test_logits_match_the_cpu(models):
    cpu, gpu = models
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        a, b = cpu(ids, pos), gpu(ids.cuda(), pos.cuda()).cpu()
    torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_engine_equals_generate_on_the_gpu(models, kv_cache):
    _, gpu = models
    engine = LLMEngine(gpu, max_num_seqs=4, kv_cache=kv_cache)
    served = drive(engine, [(0, p, PARAMS) for p in PROMPTS])
    assert [r.seq.output_ids for r in served.values()] == [generate(gpu, p, PARAMS)
                                                           for p in PROMPTS]


def test_int8_matmul_is_exact_on_the_gpu():
    g = torch.Generator().manual_seed(0)
    for m in (1, 5, 17, 64):
        a = torch.randint(-127, 128, (m, 256), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (256, 512), generator=g, dtype=torch.int8)
        ref = (a.double() @ b.double()).to(torch.int32)
        assert torch.equal(int8_matmul(a.cuda(), b.cuda()).cpu(), ref)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_int8_modes_generate_like_their_cpu_twins(models, mode):
    cpu, gpu = models
    import copy
    qc, qg = quantize(copy.deepcopy(cpu), mode), quantize(copy.deepcopy(gpu), mode)
    agree = [a == b for p in PROMPTS[:3]
             for a, b in zip(generate(qc, p, greedy(16, ignore_eos=True)),
                             generate(qg, p, greedy(16, ignore_eos=True)))]
    assert sum(agree) / len(agree) > 0.9  # float rounding may flip near-ties


def test_gpu_memory_utilization_sizes_the_pool_from_a_warm_up(models):
    """The pool fits in the share asked for, beside the weights and the warm-up
    peak, and the engine still gives generate's tokens."""
    _, gpu = models
    total = torch.cuda.mem_get_info()[1]
    engine = LLMEngine(gpu, max_num_seqs=4, kv_cache="paged",
                       gpu_memory_utilization=0.05)
    assert 0 < engine.kv.nbytes <= 0.05 * total
    served = drive(engine, [(0, p, PARAMS) for p in PROMPTS])
    assert [r.seq.output_ids for r in served.values()] == [generate(gpu, p, PARAMS)
                                                           for p in PROMPTS]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_at_a_real_shape(dtype):
    """SmolLM2-135M's shape (30 layers, 9 query and 3 K/V heads, random weights) in
    float16 and bfloat16: our logits next to transformers', then the engine (paged,
    CUDA graphs) against generate, token for token."""
    from minillm.bench.decode import agreement, model_pair
    if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        pytest.skip("this GPU has no native bfloat16")
    ours, hf = model_pair("SmolLM2-135M", dtype, torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ours.config.vocab_size, (2, 64), generator=g).cuda()
    with torch.inference_mode():
        a = ours(ids, torch.arange(64, device="cuda").expand(2, -1)).float()
        b = hf(ids).logits.float()
    assert ((a - b).abs().amax() / b.abs().amax()).item() < 0.03
    with torch.no_grad():  # spread the logits: random weights are near-tied
        ours.lm_head.weight.mul_(30)
    prompts = [torch.randint(0, 40000, (16 + 8 * i,), generator=g).tolist()
               for i in range(4)]
    engine = LLMEngine(ours, max_num_seqs=4, kv_cache="paged", cuda_graphs=True)
    assert engine.runner.forward.graphs  # recorded
    served = drive(engine, [(0, p, PARAMS) for p in prompts])
    same = [agreement(r.seq.output_ids, generate(ours, p, PARAMS))
            for r, p in zip(served.values(), prompts)]
    assert engine.runner.forward.replays > 0 and min(same) >= PARAMS.max_tokens // 2, same


def test_a_decode_step_waits_for_the_gpu_once():
    """torch.cuda's sync debug mode warns at every call that waits for the GPU: the
    sampler's one read, and a copy from pageable memory (the step's inputs come from
    pinned memory, without a wait)."""
    import warnings
    gpu = load_model(bundled_model_path(), dtype=torch.float32, device="cuda")
    for graphs in (False, True):
        engine = LLMEngine(gpu, max_num_seqs=4, kv_cache="paged", cuda_graphs=graphs)
        for p in PROMPTS[:3]:
            engine.add_request(p, PARAMS)
        engine.step()  # the prefill
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        waits = [w for w in seen if "synchroniz" in str(w.message)]
        assert len(waits) == 1, [str(w.message) for w in waits]


def test_w8a8_does_not_copy_its_weight_per_forward():
    """The int8 weight goes to torch._int_mm as weight.t(), a view: a forward
    allocates far less than the weight's size."""
    from minillm.quant.int8 import Int8Int8Linear
    layer = Int8Int8Linear.from_linear(torch.nn.Linear(4096, 4096, bias=False).cuda())
    x = torch.randn(1, 4096, device="cuda")
    layer(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    layer(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < layer.weight.numel() // 4
