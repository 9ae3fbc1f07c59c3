"""minillm.kv.paged (chapter 6): the engine on blocks gives every request the tokens of
chapter 3's `generate` for it alone: with room to spare, under a budget so tight that
requests are preempted and computed again, and with prefix-cache hits; a random run of
add / step / abort ends with every block free."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import drive, greedy
from minillm.engine import LLMEngine
from minillm.kv.paged import PagedKVCache
from minillm.generate import generate

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(llama):
    return llama[1]


def paged_engine(model, num_blocks: int, block_size: int = 4, prefix: bool = True,
                 max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(model, None, max_num_seqs=max_num_seqs, max_model_len=64,
                     kv_cache="paged", num_blocks=num_blocks, block_size=block_size,
                     enable_prefix_caching=prefix)


def assert_all_free(engine) -> None:
    bm = engine.kv.blocks
    bm.check()
    assert bm.tables == {} and bm.num_free == bm.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def requests_of(seed: int, n: int, shared: list[int] | None = None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = (shared or []) + [rng.randrange(3, 100) for _ in range(rng.randint(1, 11))]
        out.append((prompt, greedy(rng.randint(1, 14), ignore_eos=True)))
    return out


@pytest.mark.parametrize("num_blocks, prefix", [(200, False), (200, True), (12, False),
                                                (12, True), (9, True)])
def test_paged_engine_gives_solo_tokens(model, num_blocks, prefix):
    requests = requests_of(1, 10, shared=[1, 5, 9, 13, 17, 21, 25, 29, 33])
    engine = paged_engine(model, num_blocks, prefix=prefix)
    arrivals = [0, 0, 0, 1, 2, 2, 5, 9, 9, 20]
    got = drive(engine, [(step, *r) for step, r in zip(arrivals, requests)], max_steps=5000)
    assert len(got) == len(requests)
    for rid, (prompt, params, _, seq) in got.items():
        assert seq.output_ids == generate(model, prompt, params), rid
    assert_all_free(engine)
    if num_blocks <= 12:  # the budget was too small for everyone at once
        assert engine.scheduler.num_preemptions > 0
    if prefix:
        assert engine.kv.blocks.hits > 0  # the shared 9-token start was found


def test_prefix_hit_skips_the_cached_tokens(model):
    engine = paged_engine(model, 40)
    system = list(range(3, 20))  # 17 tokens: 4 full blocks of 4
    params = greedy(2, ignore_eos=True)
    first = engine.add_request(system + [50], params)
    while engine.has_unfinished():
        engine.step()
    second = engine.add_request(system + [60, 61], params)
    batch = engine.scheduler.schedule()
    assert batch.is_prefill and engine.kv.blocks.hits == 4  # 4 blocks of 4 found
    assert batch.seqs[0].num_computed_tokens == 16 and batch.num_new == [3]
    ids, meta = engine.runner.prepare_packed(batch.seqs, batch.num_new)
    assert ids.shape == (1, 3)  # only the 3 tokens after the cached 16
    assert meta.positions.tolist() == [[16, 17, 18]]
    engine.scheduler.undo(batch)
    while engine.has_unfinished():
        engine.step()
    assert engine.pop(second).output_ids == generate(model, system + [60, 61], params)
    assert engine.pop(first).output_ids == generate(model, system + [50], params)
    assert_all_free(engine)


def test_random_add_step_abort_leaves_every_block_free(model):
    rng = random.Random(7)
    engine = paged_engine(model, 10)
    live, want = {}, {}
    for _ in range(300):
        r = rng.random()
        if r < 0.25 and len(live) < 12:
            prompt = [1, 2, 3, 4, 5][:rng.randint(0, 5)] + [rng.randrange(3, 100)
                                                            for _ in range(rng.randint(1, 8))]
            params = greedy(rng.randint(1, 10), ignore_eos=True)
            rid = engine.add_request(prompt, params)
            live[rid], want[rid] = True, (prompt, params)
        elif r < 0.3 and live:
            rid = rng.choice(sorted(live))
            engine.abort(rid)
        else:
            engine.step()
        engine.kv.blocks.check()
        for rid in [r for r in live if engine.requests[r].is_finished]:
            seq = engine.pop(rid)
            del live[rid]
            if seq.finish_reason != "abort":
                assert seq.output_ids == generate(model, *want[rid])
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)


def test_a_request_longer_than_the_pool_is_refused_up_front(model):
    engine = paged_engine(model, 3, block_size=4)  # 12 positions in all
    ok = engine.add_request([5, 6, 7], greedy(4, ignore_eos=True))
    with pytest.raises(ValueError, match="blocks"):
        engine.add_request([5] * 10, greedy(8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop(ok).output_ids) == 4
    assert_all_free(engine)


@pytest.mark.parametrize("kwargs", [{}, {"num_blocks": 4, "kv_cache_bytes": 10**6},
                                    {"kv_cache_bytes": 10}, {"num_blocks": 0},
                                    {"num_blocks": 8, "block_size": 6}])
def test_bad_pool_sizes_are_refused(model, kwargs):
    with pytest.raises(ValueError):
        PagedKVCache.from_model(model, **kwargs)


@pytest.mark.parametrize("kwargs", [{"kv_cache": "pages"},
                                    {"kv_cache": "slots", "num_blocks": 8},
                                    {"kv_cache": "paged", "policy": "static"},
                                    {"kv_cache": "paged", "block_size": 12},
                                    {"kv_cache": "paged", "blocks": 8}])
def test_bad_engine_options_are_refused(model, kwargs):
    with pytest.raises((ValueError, TypeError)):
        LLMEngine(model, None, **kwargs)


def test_default_pool_matches_the_slots_memory(model):
    engine = LLMEngine(model, None, max_num_seqs=4, max_model_len=64, kv_cache="paged")
    assert engine.kv.num_blocks * engine.kv.block_size == 4 * 64


def test_paged_is_the_default_for_continuous_batching(model):
    assert isinstance(LLMEngine(model, None, max_num_seqs=2).kv, PagedKVCache)
    static = LLMEngine(model, None, max_num_seqs=2, policy="static")
    assert not isinstance(static.kv, PagedKVCache)  # static batching keeps its slots
