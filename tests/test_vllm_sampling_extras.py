"""Issue 38, the rest of vLLM's offline front door: SamplingParams(max_tokens=None) runs up
to the context (the engine's max_model_len, or the model's context in chapter 2's and
chapter 3's loops); logit_bias (OpenAI's {token id: bias in [-100, 100]}) is added to the
logits before the penalties and the temperature; prompt_logprobs=k gives vLLM's
RequestOutput.prompt_logprobs, checked against a plain forward of the model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from minillm.engine.llm import LLM
from minillm.engine.llm_engine import LLMEngine
from minillm.generate import generate
from minillm.model.naive import naive_generate
from minillm import sampling
from minillm.sampling import SamplingParams, filter_logits, sample
from minillm.utils import bundled_model_path

PROMPT = "ROMEO:\nWhat light"
MAX_LOGIT_BIAS = 1024  # entries (sampling.MAX_LOGIT_BIAS)


@pytest.fixture(scope="module")
def llm():
    return LLM(bundled_model_path(), device="cpu", max_num_seqs=4, max_model_len=48)


def ids_of(llm, text=PROMPT) -> list[int]:
    return llm.get_tokenizer().encode(text)


# --- max_tokens=None: up to the context --------------------------------------------

def test_max_tokens_none_runs_to_max_model_len(llm):
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    answer = out.outputs[0]
    assert len(out.prompt_token_ids) + len(answer.token_ids) == 48
    assert answer.finish_reason == "length"
    # the same tokens as asking for exactly what is left
    left = 48 - len(out.prompt_token_ids)
    same = llm.generate(PROMPT, dataclasses.replace(params, max_tokens=left),
                        use_tqdm=False)[0]
    assert same.outputs[0].token_ids == answer.token_ids


def test_max_tokens_none_with_min_tokens_and_n(llm):
    params = SamplingParams(max_tokens=None, min_tokens=5, n=2, seed=1)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for answer in out.outputs:
        assert 5 <= len(answer.token_ids) <= 48 - len(out.prompt_token_ids)


def test_a_prompt_that_fills_the_context_is_refused_by_name(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match=r"fills max_model_len of 48 tokens.*"
                                         r"max_tokens=None"):
        engine.add_request([5] * 48, SamplingParams(max_tokens=None))
    assert not engine.requests and not engine.has_unfinished()
    with pytest.raises(ValueError, match="max_tokens=0 is not allowed.*or None"):
        SamplingParams(max_tokens=0)


def test_chapter_2_and_3_loops_run_to_the_models_context(llama):
    _, model = llama  # a tiny random Llama: a context of 128 positions
    context = model.config.context_length
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    prompt = [1, 5, 9]
    naive = naive_generate(model, prompt, params)
    assert len(naive) == context - len(prompt)
    assert generate(model, prompt, params) == naive
    with pytest.raises(ValueError, match=r"fills the model.s context of 128 tokens"):
        naive_generate(model, [5] * context, params)
    with pytest.raises(ValueError, match=r"exceeds the model's context of 128"):
        naive_generate(model, [5] * 100, dataclasses.replace(params, max_tokens=29))


# --- logit_bias ---------------------------------------------------------------------

@pytest.mark.parametrize("bias, message", [
    ({-1: 5}, "keys are token ids"),
    ({"50": 5}, "keys are token ids"),
    ({True: 5}, "keys are token ids"),
    ({3: 100.5}, r"values are numbers in \[-100, 100\]"),
    ({3: float("nan")}, r"values are numbers in \[-100, 100\]"),
    ({3: "5"}, r"values are numbers in \[-100, 100\]"),
    ([3, 5], "a dict"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS} entries"),
])
def test_bad_logit_bias_is_refused_by_name(bias, message):
    with pytest.raises(ValueError, match="logit_bias=.*" + message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_normalised():
    assert sampling.MAX_LOGIT_BIAS == MAX_LOGIT_BIAS
    p = SamplingParams(logit_bias={3: 1, 7: -100})
    assert p.logit_bias == {3: 1.0, 7: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_logit_bias_is_added_before_penalties_and_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    bias = {3: 5.0, 10: -2.5}
    params = SamplingParams(temperature=0.7, repetition_penalty=1.3, logit_bias=bias)
    plain = dataclasses.replace(params, logit_bias=None)
    biased = logits.clone()
    for t, b in bias.items():
        biased[:, t] += b
    prev = [[3, 4], [10, 11]]
    got = filter_logits(logits, params, prev_ids=prev)
    assert torch.allclose(got, filter_logits(biased, plain, prev_ids=prev))
    # greedy rows: the argmax of the biased logits, not the raw ones
    greedy = SamplingParams(temperature=0, logit_bias={int(logits[0].argmin()): 100})
    assert sample(logits[0], greedy).item() == int(logits[0].argmin())


def test_a_full_bias_makes_greedy_pick_that_token(llm):
    token = ids_of(llm, " light")[-1]
    params = SamplingParams(temperature=0, max_tokens=4, logit_bias={token: 100})
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [token] * 4
    # -100 bans the token greedy picks without a bias
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1,
                                                 logit_bias={plain: -100}),
                          use_tqdm=False)[0].outputs[0].token_ids[0]
    assert banned != plain
    # with logprobs: the reported distribution is the biased one
    asked = llm.generate(PROMPT, dataclasses.replace(params, logprobs=1),
                         use_tqdm=False)[0].outputs[0]
    assert asked.token_ids == [token] * 4
    assert all(lp[token].rank == 1 for lp in asked.logprobs)


def test_a_bias_outside_the_vocabulary_is_refused_before_any_work(llm):
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias ids \[{vocab}\] are outside "
                                         rf"the vocabulary \[0, {vocab}\)"):
        engine.add_request(PROMPT, SamplingParams(logit_bias={vocab: 1, 3: 1}))
    assert not engine.requests and not engine.has_unfinished()


# --- prompt_logprobs -----------------------------------------------------------------

def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """A plain forward of the whole prompt: log_softmax in float32, [T, V]."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    return logits.float().log_softmax(-1)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_prompt_logprobs_match_a_plain_forward(llm, k):
    ids = ids_of(llm)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    logp = reference_logprobs(llm.engine.model, ids)
    tok = llm.get_tokenizer()
    for t in range(1, len(ids)):
        row, entry = logp[t - 1], got[t]
        best = row.topk(k).indices.tolist() if k else []
        assert set(entry) == set(best) | {ids[t]}
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(row[token].item(), abs=1e-5)
            assert lp.rank == int((row > row[token]).sum()) + 1
            assert lp.decoded_token == tok.decode([token])
    # the answer itself is what it is without prompt_logprobs
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_with_n_and_from_the_engines_steps(llm):
    engine = LLMEngine(llm.engine.model, llm.get_tokenizer(), max_num_seqs=2)
    params = SamplingParams(max_tokens=3, n=2, seed=0, prompt_logprobs=2)
    rid = engine.add_request(PROMPT, params)
    first = engine.step()[0]
    assert first.request_id == rid and len(first.prompt_logprobs) == len(
        first.prompt_token_ids)
    while engine.has_unfinished():
        engine.step()
    seqs = engine.pop(rid)
    assert seqs[0].prompt_logprobs is seqs[1].prompt_logprobs is not None


def forwards(model) -> list:
    """A counter of the model's forwards (a hook on the model)."""
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_prompt_logprobs_come_from_chunked_prefills_own_logits(llm):
    """Issue 71, H1: add_request did a forward over the whole prompt on the engine
    thread (2,000 prompt ids kept every other request waiting 17 s). Now the
    prompt's log-probabilities come from the chunks' own logits: no forward in
    add_request, one per step, equal to a plain forward's; a request beside it gets
    its tokens while the long prompt is still being computed; the prefix cache
    neither gives such a request blocks nor takes its blocks."""
    ids = ids_of(llm, PROMPT * 40)  # ten chunks of 16
    engine = LLMEngine(llm.engine.model, llm.get_tokenizer(), max_num_seqs=4,
                       max_num_batched_tokens=16, max_model_len=512)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))  # cached
    while engine.has_unfinished():
        engine.step()
    probe = engine.add_request(ids[:3], SamplingParams(temperature=0, max_tokens=6))
    engine.step()  # the probe is decoding
    calls = forwards(engine.model)
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2,
                                                 prompt_logprobs=3))
    assert calls == []  # no work when it arrives
    steps, probe_done_at = 0, None
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if probe_done_at is None and engine.requests[probe].is_finished:
            probe_done_at = steps
    assert len(calls) == steps  # one forward per step, none more
    assert probe_done_at == 5 and steps > len(ids) // 16  # a token every step
    got = engine.pop(rid).prompt_logprobs
    logp = reference_logprobs(engine.model, ids)
    assert len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
        for token, lp in got[t].items():
            assert lp.logprob == pytest.approx(logp[t - 1, token].item(), abs=1e-4)
        assert ids[t] in got[t] and len(got[t]) in (3, 4)
    assert engine.kv.blocks.num_free == engine.kv.blocks.num_blocks


def test_prompt_logprobs_is_bounded_as_logprobs():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match=r"prompt_logprobs=.*\[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)
