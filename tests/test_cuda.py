"""The GPU paths of the engine, against their CPU results. Marked `cuda`: skipped on a
machine without a CUDA GPU; tools/gpu_check.sh runs them on one."""
import pytest
import torch

from helpers import drive, greedy
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.model import load_model
from minillm.quant import int8_matmul, quantize
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
