"""One token budget per step (chapter 4): packed steps and chunked prefill.

A step's new tokens sit side by side in one row (no padding); running requests get their
decode token first and waiting prompts fill the rest of max_num_batched_tokens, cut into
chunks when they are longer. Every request still gets the tokens of chapter 3's `generate`
for it alone: with slots and with blocks, with prefix caching and under preemption."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import drive, greedy
from minillm.engine import LLMEngine
from minillm.engine.paged_scheduler import PagedScheduler
from minillm.engine.scheduler import Batch, Scheduler
from minillm.generate import generate
from minillm.kv.paged import PagedKVCache
from minillm.kv.slots import SlotKVCache
from minillm.model.transformer import StepMeta
from minillm.sequence import Sequence

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(llama):
    return llama[1]


def serve_all(engine, requests, arrivals=None):
    arrivals = arrivals or [0] * len(requests)
    return drive(engine, [(a, *r) for a, r in zip(arrivals, requests)], max_steps=5000)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_a_prompt_longer_than_the_budget_is_cut_into_chunks(model, kv_cache):
    budget = 8
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=budget,
                       max_model_len=64, kv_cache=kv_cache,
                       **({"block_size": 4, "num_blocks": 64} if kv_cache == "paged" else {}))
    long_prompt = [1] + [random.Random(3).randrange(3, 100) for _ in range(29)]  # 30
    short = ([1, 7, 9], greedy(12, ignore_eos=True))
    served = serve_all(engine, [short, (long_prompt, greedy(5, ignore_eos=True))], [0, 2])
    for prompt, params, streamed, seq in served.values():
        assert streamed == seq.output_ids == generate(model, prompt, params)
    history = engine.history
    assert all(r.tokens <= budget for r in history)
    assert all(r.tokens == r.useful_tokens for r in history)  # packed: no padding
    # the short request decodes while the long prompt is computed: 7 tokens a step
    chunked = [r for r in history if r.is_prefill and r.rows == 2]
    assert len(chunked) >= 30 // (budget - 1)
    assert all(r.tokens == budget for r in chunked[:-1])


def test_a_long_prompt_shares_steps_with_decoding_requests(model):
    """With chunks the long prompt starts at once, and the running request gets its token
    in every step. Without, the prompt must fit the step whole: with a decode token in
    every step it never does, so it waits until the running request has finished."""
    seen = {}
    for chunked in (True, False):
        engine = LLMEngine(model, max_num_seqs=2, max_num_batched_tokens=40,
                           max_model_len=64, kv_cache="slots",
                           enable_chunked_prefill=chunked)
        first = engine.add_request([1, 4, 6], greedy(20, ignore_eos=True))
        engine.step()
        long_one = engine.add_request([1] + list(range(3, 42)), greedy(2, ignore_eos=True))
        got = []
        while engine.has_unfinished():
            got.append({o.request_id for o in engine.step()})
        seen[chunked] = got
        assert all(r.tokens <= 40 for r in engine.history)
    steps = seen[True]
    assert all(first in s for s in steps[:19])  # its 19 other tokens, one per step
    assert long_one in steps[1]  # 39 tokens, then 1: its first token in the second step
    steps = seen[False]
    assert all(long_one not in s for s in steps[:19])  # head of the queue, waiting
    assert long_one in steps[19]  # computed whole once the first has finished


def test_chunks_publish_only_the_blocks_they_wrote(model):
    """Prefix caching: a block of a prompt computed in chunks becomes shareable only
    after the chunk that writes its last token."""
    engine = LLMEngine(model, max_num_seqs=2, max_num_batched_tokens=6, max_model_len=64,
                       kv_cache="paged", block_size=4, num_blocks=32)
    prompt = list(range(3, 23))  # 20 tokens: 5 full blocks
    rid = engine.add_request(prompt, greedy(3, ignore_eos=True))
    engine.step()  # tokens 0..5: block 0 full, block 1 half
    assert len(engine.kv.blocks.cached) == 1
    engine.step()  # tokens 6..11: blocks 1 and 2
    assert len(engine.kv.blocks.cached) == 3
    other = engine.add_request(prompt[:16] + [90, 91], greedy(3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.pop(rid).output_ids == generate(model, prompt, greedy(3, ignore_eos=True))
    seq = engine.pop(other)
    assert seq.output_ids == generate(model, prompt[:16] + [90, 91],
                                      greedy(3, ignore_eos=True))
    assert engine.kv.blocks.hits >= 3  # found what the first request had written
    engine.kv.blocks.check()


def test_recompute_after_preemption_is_chunked_too(model):
    """Without chunks a preempted request must be recomputed in one step (refused when
    it could not be); with them it spans steps: the same tokens, within the budget."""
    engine = LLMEngine(model, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
                       kv_cache="paged", block_size=4, num_blocks=14)
    rng = random.Random(5)
    requests = [([1] + [rng.randrange(3, 100) for _ in range(19)],
                 greedy(12, ignore_eos=True)) for _ in range(3)]  # 32 tokens each
    served = serve_all(engine, requests, [0, 0, 1])
    for prompt, params, streamed, seq in served.values():
        assert streamed == seq.output_ids == generate(model, prompt, params)
    assert engine.scheduler.num_preemptions > 0
    assert all(r.tokens <= 16 for r in engine.history)
    engine.kv.blocks.check()
    assert engine.kv.blocks.num_free == engine.kv.blocks.num_blocks


def test_packed_forward_equals_each_request_alone(model):
    """One packed forward: a decode token after a cached prompt, a chunk after a cached
    prefix, and a whole new prompt. Each request's logits equal its own forward."""
    kv = PagedKVCache.from_model(model, num_blocks=32, block_size=4,
                                 enable_prefix_caching=False)
    prompts = {"a": [1, 5, 8, 13, 21, 34], "b": [1, 9, 2, 7, 4, 4, 3, 8, 6], "c": [1, 3, 3]}
    done = {"a": 5, "b": 4, "c": 0}  # tokens already in the cache before the step
    seqs = []
    with torch.inference_mode():
        for rid, prompt in prompts.items():
            seq = Sequence.create(model, prompt, greedy(4), request_id=rid)
            kv.allocate(seq)
            n = done[rid]
            if n:  # write its first n tokens, alone
                table = kv.block_table(seq)
                meta = StepMeta(positions=torch.arange(n)[None],
                                slot_mapping=torch.tensor([kv.slots(seq, 0, n)]),
                                block_tables=torch.tensor([table]), max_context=n)
                model(torch.tensor([prompt[:n]]), meta.positions, kv=kv, meta=meta)
            seq.num_computed_tokens = n
            seqs.append(seq)
        from minillm.engine.runner import ModelRunner
        runner = ModelRunner(model, kv)
        batch = Batch(seqs, [len(p) - done[r] for r, p in prompts.items()])
        assert batch.is_prefill
        ids, meta = runner.prepare_packed(batch.seqs, batch.num_new)
        assert ids.shape == (1, 1 + 5 + 3)  # every new token, side by side
        assert meta.query_start_loc.tolist() == [0, 1, 6, 9]
        assert meta.seq_lens.tolist() == [6, 9, 3]
        logits = model(ids, meta.positions, kv=kv, meta=meta)[:, -1]
        assert logits.shape == (3, model.config.vocab_size)
        for i, prompt in enumerate(prompts.values()):
            alone = model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0, -1]
            assert (logits[i] - alone).abs().max().item() < 1e-4


def test_paged_gather_reads_into_one_buffer_for_every_layer(model):
    kv = PagedKVCache.from_model(model, num_blocks=16, block_size=4,
                                 enable_prefix_caching=False)
    for layer in range(len(kv.k)):
        kv.k[layer].normal_()
        kv.v[layer].normal_()
    tables = torch.tensor([[3, 9, 1], [12, 0, 0]])
    meta = StepMeta(positions=torch.zeros(2, 1, dtype=torch.long), block_tables=tables,
                    max_context=10)
    pointers = set()
    for layer in range(len(kv.k)):
        k, v = kv.gather(layer, meta)
        blocks_k, blocks_v = kv.rows(layer)
        want_k = blocks_k[tables].flatten(1, 2)[:, :10].transpose(1, 2)
        want_v = blocks_v[tables].flatten(1, 2)[:, :10].transpose(1, 2)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        pointers.add((k.data_ptr(), v.data_ptr()))
    assert len(pointers) == 1  # the same two buffers, layer after layer


def test_one_budget_order_running_first_then_fifo(model):
    """The scheduler's order: running requests first (decode tokens, then the next chunk
    of a prompt in progress), then waiting ones in arrival order, within the budget."""
    kv = SlotKVCache.from_model(model, max_num_seqs=4, max_seq_len=64)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=10)
    seqs = [Sequence.create(model, [1] * n, greedy(3), request_id=str(i))
            for i, n in enumerate([4, 12, 5])]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()  # 4 + the first 6 of 12; the third waits
    assert batch.seqs == seqs[:2] and batch.num_new == [4, 6] and batch.num_admitted == 2
    seqs[0].num_computed_tokens, seqs[1].num_computed_tokens = 4, 6
    seqs[0].output_ids.append(7)  # the first one sampled its token
    # decode 1; the long prompt leaves the waiting third half the budget: 4 of its
    # last 6 (10 - 1 - 10 // 2), then the third's whole prompt, 5
    batch = sched.schedule()
    assert batch.seqs == seqs and batch.num_new == [1, 4, 5] and batch.num_admitted == 1


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_a_short_request_waits_one_step_behind_a_long_prompt(model, kv_cache):
    """Before: a 120-token prompt in chunks of 16 took the whole budget for 7 steps,
    and a 3-token request sent after its first step finished only after them. While
    requests wait, a prompt's chunk leaves them half the budget."""
    from minillm.engine.llm_engine import LLMEngine
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=16,
                       kv_cache=kv_cache)
    engine.add_request([5 + j % 90 for j in range(120)], greedy(2), request_id="long")
    engine.step()
    engine.add_request([5, 6, 7], greedy(1), request_id="short")
    finished = {}
    for step in range(1, 20):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = step
        assert engine.history[-1].tokens <= 16
        if not engine.has_unfinished():
            break
    assert finished["short"] == 1 and finished["long"] > 6


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_enable_chunked_prefill_must_be_a_bool(model, value):
    with pytest.raises(ValueError, match=f"enable_chunked_prefill={value!r}"):
        LLMEngine(model, enable_chunked_prefill=value)


def test_a_budget_below_max_num_seqs_is_refused(model):
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 is less than "
                                         "max_num_seqs=8"):
        LLMEngine(model, max_num_seqs=8, max_num_batched_tokens=4)


@pytest.mark.parametrize("seed", range(3))
def test_random_arrivals_with_chunks_give_solo_tokens(model, seed):
    rng = random.Random(seed)
    requests = [([1] + [rng.randrange(3, 100) for _ in range(rng.randint(1, 30))],
                 greedy(rng.randint(1, 10), ignore_eos=True)) for _ in range(10)]
    arrivals = sorted(rng.randrange(0, 30) for _ in requests)
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=rng.choice([6, 9, 16]),
                       max_model_len=48, kv_cache="paged", block_size=4,
                       num_blocks=rng.choice([14, 40]))
    for prompt, params, streamed, seq in serve_all(engine, requests, arrivals).values():
        assert streamed == seq.output_ids == generate(model, prompt, params)
    assert all(r.tokens == r.useful_tokens <= engine.scheduler.max_num_batched_tokens
               for r in engine.history)
    engine.kv.blocks.check()
    assert engine.kv.blocks.num_free == engine.kv.blocks.num_blocks


def test_a_victim_scheduled_earlier_in_the_step_leaves_the_batch(model):
    """With a victim policy that preempts the oldest running request, the victim may
    have been given its token earlier in the same step: it must leave the batch."""
    class OldestFirst(PagedScheduler):
        def victim(self):
            return self.running[0]
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=64, kv_cache="paged",
                       block_size=4, num_blocks=10)
    engine.scheduler.__class__ = OldestFirst
    rng = random.Random(7)
    requests = [([1] + [rng.randrange(3, 100) for _ in range(6)],
                 greedy(14, ignore_eos=True)) for _ in range(4)]
    for prompt, params, streamed, seq in serve_all(engine, requests).values():
        assert streamed == seq.output_ids == generate(model, prompt, params)
    assert engine.scheduler.num_preemptions > 0
    engine.kv.blocks.check()


def test_chapter_4s_picture_of_one_budget_is_what_the_scheduler_does(model):
    """Chapter 4 §5 draws A and B decoding while C (12 prompt tokens) and D (5) arrive,
    with a budget of 8: these three steps."""
    kv = SlotKVCache.from_model(model, max_num_seqs=4, max_seq_len=64)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = (Sequence.create(model, [5, 6], greedy(5), request_id=x) for x in "AB")
    sched.add(a, b)
    for s, n in zip(*(lambda bt: (bt.seqs, bt.num_new))(sched.schedule())):
        s.num_computed_tokens += n
        s.output_ids.append(7)
    sched.add(Sequence.create(model, [5] * 12, greedy(5), request_id="C"))
    sched.add(Sequence.create(model, [5] * 5, greedy(5), request_id="D"))
    steps = []
    for _ in range(3):
        batch = sched.schedule()
        steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new)])
        for s, n in zip(batch.seqs, batch.num_new):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.output_ids.append(7)
    assert steps == [[("A", 1), ("B", 1), ("C", 6)],
                     [("A", 1), ("B", 1), ("C", 2), ("D", 4)],
                     [("A", 1), ("B", 1), ("C", 4), ("D", 1)]]


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_a_request_of_128_answers_leaves_rows_to_a_request_of_one(model, kv_cache):
    """Before: n=128 on 32 rows put its extra answers ahead of everyone (chapter 6 at
    the front of the queue), and a 1-token request sent a step later waited 200 steps.
    Extra answers leave an eighth of the rows free: it finishes in the next step."""
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling import SamplingParams
    engine = LLMEngine(model, max_num_seqs=32, max_model_len=64, kv_cache=kv_cache)
    engine.add_request([5, 6, 7, 8], SamplingParams(
        n=128, max_tokens=20, ignore_eos=True, temperature=1.0, seed=1))
    engine.step()
    engine.add_request([5, 6, 7], greedy(1), request_id="short")
    steps = 0
    while not engine.is_finished("short"):
        engine.step()
        steps += 1
        extras = sum(s.index > 0 for s in engine.scheduler.running)
        assert extras <= 28
    assert steps == 1
    while engine.has_unfinished():
        engine.step()
    assert all(len(a.output_ids) == 20 for a in engine.pop(
        next(r for r in engine.groups if r != "short")))


@pytest.mark.parametrize("max_num_seqs", [8, 32])
def test_a_list_of_prompts_leaves_rows_to_a_request_of_one(model, max_num_seqs):
    """Issue 71, M2: a server's list of 128 prompts is 128 requests; they held every
    row, and a 1-token request waited for them. The later prompts follow the first
    (add_request(..., follows=...)) and ride along as n > 1's extra answers do: with
    the first they leave an eighth of the rows (at least one), so the short request
    finishes in the next step. (The rule counted the extras alone: on 8 rows n=8
    left none.)"""
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling import SamplingParams
    engine = LLMEngine(model, max_num_seqs=max_num_seqs, max_model_len=64)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    first = engine.add_request([5, 6, 7, 8], params)
    for i in range(127):
        engine.add_request([5, 6, 7, 9 + i % 5], params, follows=first)
    engine.step()
    engine.add_request([5, 6, 7], greedy(1), request_id="short")
    steps = 0
    while not engine.is_finished("short"):
        engine.step()
        steps += 1
        assert len(engine.scheduler.running) <= max_num_seqs
    assert steps == 1
    with pytest.raises(ValueError, match="follows=5: give the id"):
        engine.add_request([5, 6], params, follows=5)
    while engine.has_unfinished():
        engine.step()
