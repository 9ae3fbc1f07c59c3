"""Chapter 12, batch invariance (issue 55), vLLM's kind of test
(test_logprobs_bitwise_batch_invariance_bs1_vs_bsN): with batch_invariant=True a request's
logprobs are the same bits alone and among random companions, in a whole or a chunked
prefill, from the prefix cache or not, in a speculative verify or a plain decode step, on
slots and on pages, in float32 and bfloat16; a seeded, sampled answer is the same text.
Each comparison is also run with the mode off, where it differs on this CPU: the test
can fail. The model is SmolLM2-135M's shape with two layers and random weights (its
float32 matmuls pick their kernel by the number of rows, as the real model's do)."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from minillm.bench.folders import random_model_folder
from minillm.engine.llm import LLM
from minillm.invariant.ops import (FixedOrderAttention, FixedRowsLinear,
                                   fixed_order_attention, fixed_rows,
                                   make_batch_invariant)
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer
from minillm.model.sources import real_model

VOCAB = 49152
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
ON = {"batch_invariant": True}


@pytest.fixture(autouse=True)
def two_threads():
    """Each test on two threads, whatever other modules set at import: the "off"
    cases need this CPU's kernels to split the rows' work differently by batch size
    (on one thread, a decode step and a verify row got the same bits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shaped():
    """SmolLM2's shape, two layers, random weights, and SmolLM2's tokenizer (the
    prompts are ids; every id must decode)."""
    return (str(random_model_folder("SmolLM2-135M", num_hidden_layers=2)),
            Tokenizer.from_pretrained(real_model()))


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


PROMPT = ids(random.Random(0), 65)  # 4 full blocks of 16 and one token


def engines(shaped, dtype: str, invariant: bool):
    """A factory of LLMs on one loaded model (swapped once when invariant)."""
    base = LLM(shaped[0], shaped[1], dtype=dtype, max_num_seqs=16,
               **(ON if invariant else {}))

    def make(**kw) -> LLM:
        kw = {"max_num_seqs": 16, **(ON if invariant else {}), **kw}
        return LLM(base.engine.model, shaped[1], **kw)
    return make


def probe(llm, others=(), at=0, params=GREEDY, prompt=PROMPT) -> tuple:
    """The prompt's (logprobs, token ids) when it runs at place `at` among `others`."""
    prompts = list(others[:at]) + [prompt] + list(others[at:])
    out = llm.generate(prompts, params, use_tqdm=False)[at].outputs[0]
    assert out.finish_reason == "length" and len(out.logprobs) == params.max_tokens
    return [next(iter(d.values())).logprob for d in out.logprobs], out.token_ids


def among(llm, n: int, seed: int, params=GREEDY) -> tuple:
    rng = random.Random(seed)
    return probe(llm, [ids(rng, rng.randint(8, 100)) for _ in range(n - 1)],
                 rng.randrange(n), params)


MODES = [pytest.param(True, id="on"), pytest.param(False, id="off (must differ)")]
DTYPES = ["float32", "bfloat16"]


def holds(invariant: bool, same: bool) -> None:
    """On: the bits agree. Off: this CPU's kernels make them differ, so the test
    above can fail."""
    assert same is invariant


@pytest.mark.parametrize("invariant", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_cache", ["paged", "slots"])
def test_logprobs_bitwise_batch_invariance_bs1_vs_bsN(shaped, dtype, kv_cache, invariant):
    llm = engines(shaped, dtype, invariant)(kv_cache=kv_cache)
    alone = probe(llm)
    holds(invariant, all(among(llm, n, seed=n) == alone for n in (2, 5, 16)))


@pytest.mark.parametrize("invariant", MODES)
def test_chunked_prefill_gives_the_whole_prefills_bits(shaped, invariant):
    make = engines(shaped, "float32", invariant)
    chunked = make(max_num_seqs=1, max_num_batched_tokens=3)  # chunks of 3 tokens
    holds(invariant, probe(make()) == probe(chunked))


@pytest.mark.parametrize("invariant", MODES)
def test_a_prefix_cache_hit_gives_the_misses_bits(shaped, invariant):
    llm = engines(shaped, "float32", invariant)(enable_prefix_caching=True)
    miss = probe(llm)
    steps = len(llm.engine.history)
    hit = probe(llm)
    computed = [r.tokens for r in llm.engine.history]
    assert sum(computed[:steps]) == 65 + 23  # the prompt, then one token a step
    assert sum(computed[steps:]) == 1 + 23  # 64 of 65 prompt tokens from the cache
    holds(invariant, miss == hit)


class Recorder:
    """A logits processor that keeps each row's logits by (request, the tokens it
    has generated so far, drafts included)."""

    def __init__(self):
        self.rows: dict[tuple, torch.Tensor] = {}

    def __call__(self, logits, seqs):
        for row, seq in zip(logits, seqs):
            out = seq.output_ids
            self.rows[seq.request_id, tuple(out[0:len(out)])] = row.clone()
        return logits


@pytest.mark.parametrize("invariant", MODES)
def test_a_speculative_verify_gives_a_decode_steps_bits(shaped, invariant):
    """Requests with logprobs do not speculate (chapter 10), so the logits are read
    where the sampler reads them: a verify row and a decode step for the same
    position hold the same bits."""
    make = engines(shaped, "float32", invariant)
    rng = random.Random(5)
    repeats = [ids(rng, 8) * 4 for _ in range(3)]  # prompt lookup finds drafts
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    seen = {}
    for name, llm in (("plain", make()), ("spec", make(speculative_config={
            "method": "ngram", "num_speculative_tokens": 4}))):
        recorder = Recorder()
        llm.engine.runner.logits_processors.append(recorder)
        outs = llm.generate(repeats, params, use_tqdm=False)
        index = {o.request_id: i for i, o in enumerate(outs)}
        seen[name] = ({(index[rid], done): row for (rid, done), row
                       in recorder.rows.items()}, [o.outputs[0].token_ids for o in outs])
    if invariant:  # greedy, and every logit the same: the same tokens
        assert seen["spec"][1] == seen["plain"][1]
    common = seen["plain"][0].keys() & seen["spec"][0].keys()
    assert len(common) >= 3 * 30  # every position of every answer
    holds(invariant, all(torch.equal(seen["plain"][0][k], seen["spec"][0][k])
                         for k in common))


@pytest.mark.parametrize("invariant", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_seeded_sampled_answer_is_the_same_in_any_batch(shaped, dtype, invariant):
    llm = engines(shaped, dtype, invariant)()
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=24, logprobs=0,
                            ignore_eos=True)
    alone = probe(llm, params=seeded)
    holds(invariant, all(among(llm, n, n, seeded) == alone for n in (3, 9)))


def test_fixed_rows_calls_one_shape_and_keeps_the_rows():
    shapes, w = [], torch.randn(3, 5)
    for n in (1, 16, 17, 40):
        x = torch.randn(n, 3)
        out = fixed_rows(lambda b: shapes.append(tuple(b.shape)) or b @ w, x, 16)
        assert torch.allclose(out, x @ w) and out.shape == (n, 5)
    assert set(shapes) == {(16, 3)}


def test_fixed_order_attention_is_attention_and_ignores_padding():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 33, 32), *torch.randn(2, 2, 2, 33, 32)
    at = torch.arange(33).expand(2, 33)
    out = fixed_order_attention(q, k, v, at)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           enable_gqa=True)
    assert (out - ref).abs().max() < 1e-5
    padded = [torch.cat([t, torch.randn(2, 2, 50, 32)], 2) for t in (k, v)]
    assert torch.equal(fixed_order_attention(q, *padded, at), out)


def test_make_batch_invariant_swaps_every_layer_once(shaped):
    model = LLM(shaped[0], shaped[1]).engine.model
    before = sum(p.numel() for p in model.parameters())
    make_batch_invariant(make_batch_invariant(model))  # twice: the same model
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(FixedOrderAttention) == 2
    assert kinds.count(FixedRowsLinear) == 2 * 7 + 1  # 7 per layer, and the LM head
    assert not any(isinstance(m.inner, FixedRowsLinear) for m in model.modules()
                   if isinstance(m, FixedRowsLinear))
    assert sum(p.numel() for p in model.parameters()) == before  # no new weights


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_the_option_refuses_a_value_that_is_not_a_bool(shaped, bad):
    with pytest.raises(ValueError, match="batch_invariant=.*must be True or False"):
        LLM(shaped[0], shaped[1], batch_invariant=bad)


def test_the_option_refuses_compile_decode(shaped):
    with pytest.raises(ValueError, match="batch_invariant and compile_decode"):
        LLM(shaped[0], shaped[1], batch_invariant=True, compile_decode=True)


def test_serve_takes_the_flag():
    from minillm.serve.cli import engine_args, parser
    assert engine_args(parser().parse_args(["m", "--batch-invariant"]))[
        "batch_invariant"] is True
    assert "batch_invariant" not in engine_args(parser().parse_args(["m"]))


def test_completions_under_concurrent_load_give_the_same_logprobs(shaped):
    """The server with the mode on, through the real `openai` client: the probe twice,
    each time among a different crowd sent at the same moment."""
    import openai

    from minillm.serve.app import build_app
    from minillm.serve.cli import BackgroundServer
    llm = LLM(shaped[0], shaped[1], max_num_seqs=16, **ON)
    rng = random.Random(9)

    def logprobs(client, crowd):
        ask = lambda prompt: client.completions.create(
            model="m", prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
        with ThreadPoolExecutor(len(crowd) + 1) as pool:
            others = [pool.submit(ask, c) for c in crowd]
            mine = pool.submit(ask, PROMPT)
            [f.result() for f in others]
            return mine.result().choices[0].logprobs.token_logprobs

    with BackgroundServer(build_app(llm, "m")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        first = logprobs(client, [ids(rng, rng.randint(8, 60)) for _ in range(3)])
        second = logprobs(client, [ids(rng, rng.randint(8, 60)) for _ in range(7)])
    assert len(first) == 16 and first == second


def test_a_long_prompt_runs_in_short_chunks_and_a_decoding_request_keeps_going(shaped):
    """Issue 71, M3: the fixed-order attention costs a chunk's tokens x its context,
    and the mode kept the engine's 2,048-token chunk (one chunk of a long prompt
    took about 40 s on SmolLM2). The mode's default chunk is 256 tokens
    (INVARIANT_CHUNK; max_num_batched_tokens still overrides it), and a request that
    is decoding gets a token every step while a 1,500-token prompt is computed.
    (Its attention is two matrix products of one shape per page, not an
    elementwise product over every key: test_fixed_order_attention_... holds it to
    SDPA's values and its own bits.)"""
    from minillm.engine.llm_engine import LLMEngine
    from minillm.invariant.engine import INVARIANT_CHUNK
    model = LLM(shaped[0], shaped[1], **ON).engine.model
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=2048, **ON)
    assert engine.scheduler.max_num_batched_tokens == INVARIANT_CHUNK == 256
    assert LLMEngine(model, max_num_seqs=4, max_model_len=2048,
                     max_num_batched_tokens=512,
                     **ON).scheduler.max_num_batched_tokens == 512
    probe_id = engine.add_request(PROMPT[:5], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.add_request(ids(random.Random(1), 1500), SamplingParams(
        temperature=0, max_tokens=1))
    for _ in range(7):
        before = len(engine.requests[probe_id].output_ids)
        engine.step()
        assert len(engine.requests[probe_id].output_ids) == before + 1
        assert engine.history[-1].tokens <= INVARIANT_CHUNK
    while engine.has_unfinished():
        engine.step()
