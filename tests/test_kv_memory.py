"""LLMEngine(..., gpu_memory_utilization=): the KV pool from what a warm-up step leaves
of the GPU's memory (vLLM's and nano-vllm's sizing). The arithmetic and the refusals
are tested here with a GPU's numbers; tests/test_cuda.py runs the warm-up on a GPU."""
import pytest
import torch

from minillm.engine import LLM, LLMEngine
from minillm.kv import paged
from minillm.kv.contiguous import KVMemoryError
from minillm.kv.paged import PagedKVCache, kv_bytes_from_memory
from minillm.model.loader import load_model
from minillm.utils import bundled_model_path

GiB = 2**30


@pytest.fixture(scope="module")
def model():
    return load_model(bundled_model_path(), dtype=torch.float32)


def test_the_pool_is_what_the_share_leaves_after_use_and_the_warm_up_peak():
    # 80 GiB GPU, 90% allowed; 20 GiB in use; the warm-up rose 6 GiB above it
    kv = kv_bytes_from_memory(0.9, 80 * GiB, 20 * GiB, 26 * GiB, 20 * GiB)
    assert kv == int(0.9 * 80 * GiB) - 20 * GiB - 6 * GiB
    # another process's memory counts in `used`: less for us
    assert kv_bytes_from_memory(0.9, 80 * GiB, 30 * GiB, 26 * GiB, 20 * GiB) == \
        kv - 10 * GiB


def test_no_room_left_is_a_clear_error():
    with pytest.raises(KVMemoryError, match=r"gpu_memory_utilization=0.3: 4.80 GiB of "
                       r"16.00 GiB allowed, 4.00 GiB in use.*peaked 1.00 GiB.*no room"):
        kv_bytes_from_memory(0.3, 16 * GiB, 4 * GiB, 5 * GiB, 4 * GiB)


@pytest.mark.parametrize("value", [0, -0.1, 1.5, True, "0.9", [0.9]])
def test_bad_utilization_is_refused_before_any_work(model, value, monkeypatch):
    monkeypatch.setattr(paged, "profile_kv_bytes",
                        lambda *a: pytest.fail("a warm-up ran despite a bad value"))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=.*\(0, 1\]"):
        LLMEngine(model, kv_cache="paged", gpu_memory_utilization=value)


def test_on_a_cpu_the_warm_up_refuses(model):
    with pytest.raises(ValueError, match="from a CUDA GPU's memory; the model is on "
                       "cpu: give num_blocks or kv_cache_bytes"):
        LLMEngine(model, kv_cache="paged", gpu_memory_utilization=0.9)


def test_one_way_to_size_the_pool(model):
    with pytest.raises(ValueError, match="one of num_blocks, kv_cache_bytes and "
                       "gpu_memory_utilization"):
        LLMEngine(model, kv_cache="paged", num_blocks=8, gpu_memory_utilization=0.9)


def test_the_engine_warms_up_with_its_step_budget_and_sizes_the_pool(model,
                                                                     monkeypatch):
    asked = []

    def profile(m, utilization, num_tokens, max_model_len):
        asked.append((m, utilization, num_tokens, max_model_len))
        return 37 * PagedKVCache.block_bytes(m.config, 16, torch.float32) + 5

    monkeypatch.setattr(paged, "profile_kv_bytes", profile)
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=96,
                       max_model_len=64, gpu_memory_utilization=0.8)
    assert asked == [(model, 0.8, 96, 64)]
    assert engine.kv.num_blocks == 37
    llm = LLM(model, max_num_seqs=4, gpu_memory_utilization=0.5)  # vLLM's keyword
    assert asked[-1][1:] == (0.5, llm.engine.scheduler.max_num_batched_tokens,
                             model.config.context_length)


# --- the default pool: the worst case, up to a ceiling (issue: 12 GB for a 135M model) ---

def per_block(model, block_size=16):
    return PagedKVCache.block_bytes(model.config, block_size, torch.float32)


def test_a_small_worst_case_is_the_pool_as_before(model):
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=64)  # 4 x 64 positions
    assert engine.kv.num_blocks == 4 * 64 // 16


def test_the_default_pool_stops_at_half_the_free_memory(model, monkeypatch):
    # 8 x 64 positions would be 32 blocks; the device has 20 blocks' bytes free
    monkeypatch.setattr(paged, "free_memory_bytes", lambda device: 20 * per_block(model),
                        raising=False)
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=64)
    assert engine.kv.num_blocks == 10
    # less than one request of max_model_len: that one request still fits
    monkeypatch.setattr(paged, "free_memory_bytes", lambda device: 2 * per_block(model),
                        raising=False)
    assert LLMEngine(model, max_num_seqs=8, max_model_len=64).kv.num_blocks == 4


def test_the_default_pool_stops_at_default_kv_space(model, monkeypatch):
    monkeypatch.setattr(paged, "DEFAULT_KV_SPACE", 12 * per_block(model), raising=False)
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=64)
    assert engine.kv.num_blocks == 12


def test_a_capped_pool_gives_every_request_its_solo_answer(model, monkeypatch):
    """A pool below the worst case preempts under load; the answers do not change."""
    from minillm.generate import generate
    from minillm.sampling import SamplingParams
    monkeypatch.setattr(paged, "DEFAULT_KV_SPACE", 6 * per_block(model), raising=False)
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=64)
    assert engine.kv.num_blocks == 6  # 8 requests of up to 40 tokens: 3 blocks each
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[1 + i, 5, 9, 2, 7, 3, 8, 4, 6, 11] for i in range(8)]
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished():
        engine.step()
    got = [engine.pop(str(i)).output_ids for i in range(8)]
    assert got == [generate(model, p, params) for p in prompts]
    assert engine.scheduler.num_preemptions > 0


def test_a_huge_max_num_seqs_no_longer_reserves_its_worst_case(model):
    engine = LLMEngine(model, max_num_seqs=60_000, max_model_len=64)
    assert engine.kv.nbytes <= paged.DEFAULT_KV_SPACE
