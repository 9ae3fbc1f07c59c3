"""Issue 25: the front door with vLLM's names and fields. SamplingParams' names and
defaults, RequestOutput / CompletionOutput, stop strings left out of the text (and never
streamed), stop_reason, logprobs equal to log_softmax of what the sampler used, presence
and frequency penalties, n > 1 answers that fork the prompt's blocks, LLM(seed=...)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from minillm.engine.llm import LLM
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import CompletionOutput, RequestOutput
from minillm.kv.blocks import BlockManager
from minillm.kv.paged import PagedKVCache
from minillm.model.loader import load_model
from minillm.sampling import (SamplingParams, apply_presence_frequency,
                              apply_repetition_penalty)
from minillm.sequence import Logprob, Sequence
from minillm.tokenizer import Tokenizer

SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"
PROMPT = "ROMEO:\nWhat light through yonder window breaks? It is the east"


@pytest.fixture(scope="module")
def bundled():
    return load_model(SHAKESPEARE, device="cpu"), Tokenizer.from_pretrained(SHAKESPEARE)


def drained(engine: LLMEngine) -> None:
    assert not engine.requests and not engine.groups
    assert not getattr(engine.scheduler, "held", None)
    assert not engine.has_unfinished() and engine.kv.usage()[0] == 0
    if hasattr(engine.kv, "blocks"):
        engine.kv.blocks.check()
        assert not engine.kv.blocks.tables and not engine.kv.blocks.request_keys


# --- SamplingParams ---

def test_sampling_params_have_vllms_names_and_defaults():
    p = SamplingParams()
    want = dict(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=(),
                stop_token_ids=(), ignore_eos=False, max_tokens=16, min_tokens=0,
                logprobs=None, skip_special_tokens=True,
                include_stop_str_in_output=False)
    assert {k: getattr(p, k) for k in want} == want
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's old "off"
    assert SamplingParams(stop="\n").stop == ("\n",)
    with pytest.raises(TypeError):
        SamplingParams(max_new_tokens=5)  # one name: max_tokens


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("max_tokens", 0), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("top_k", -2), ("logprobs", -1), ("logprobs", 21), ("skip_special_tokens", 1),
    ("include_stop_str_in_output", "yes"), ("min_tokens", 17)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**{field: value})


# --- the vLLM snippet ---

def test_the_vllm_quickstart_runs_unchanged():
    from minillm import LLM, SamplingParams
    prompts = ["ROMEO:\n", "JULIET:\nO Romeo"]
    llm = LLM(str(SHAKESPEARE))
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95,
                                                max_tokens=64))
    assert [type(o) for o in outs] == [RequestOutput] * 2
    assert [o.prompt for o in outs] == prompts
    first = outs[0].outputs[0]
    assert isinstance(first, CompletionOutput) and first.index == 0 and first.finished()
    assert isinstance(outs[0].outputs[0].text, str) and outs[0].outputs[0].text
    assert 0 < len(first.token_ids) <= 64 and outs[0].finished
    outs = llm.generate(prompts, sampling_params=SamplingParams(max_tokens=3),
                        use_tqdm=False)  # vLLM's keyword
    assert all(len(o.outputs[0].token_ids) <= 3 for o in outs)


# --- stop strings and stop_reason ---

def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_stop_string_is_left_out_unless_asked_and_never_streamed(bundled):
    model, tok = bundled
    llm = LLM(model, tok)
    free = llm.generate("ROMEO:\n", greedy(40, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[10:13]  # three characters from the middle of the answer
    cut = llm.generate("ROMEO:\n", greedy(40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]
    kept = llm.generate("ROMEO:\n", greedy(40, ignore_eos=True, stop=[stop],
                                           include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    engine = llm.engine  # streamed: the deltas add up to the text, with no stop string
    rid = engine.add_request("ROMEO:\n", greedy(40, ignore_eos=True, stop=[stop]))
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            assert stop not in "".join(deltas)
    assert "".join(deltas) == cut.text == engine.pop(rid).text
    drained(engine)


def test_stop_token_id_is_the_stop_reason_and_not_in_the_text(bundled):
    model, tok = bundled
    llm = LLM(model, tok)
    free = llm.generate("ROMEO:\n", greedy(30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[5]
    out = llm.generate("ROMEO:\n", greedy(30, ignore_eos=True, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    end = free.token_ids.index(stop_id) + 1
    assert out.token_ids == free.token_ids[:end]  # the id is kept, as vLLM does
    assert out.stop_reason == stop_id and out.finish_reason == "stop"
    assert out.text == tok.decode(free.token_ids[:end - 1], skip_special_tokens=True)


def test_eos_has_no_stop_reason_and_special_tokens_can_stay(bundled):
    model, tok = bundled
    eos = model.config.eos_token_ids[0]
    seq = Sequence.create(model, [1], greedy(3), tok)
    seq.append(tok.encode("O", add_special_tokens=False)[0])
    seq.append(eos)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)
    keep = Sequence.create(model, [1], greedy(3, ignore_eos=True,
                                              skip_special_tokens=False), tok)
    keep.append(eos)
    assert tok.decode([eos]) in keep.text
    skip = Sequence.create(model, [1], greedy(3, ignore_eos=True), tok)
    skip.append(eos)
    assert skip.text == ""


# --- logprobs ---

def reference_logprobs(model, prompt, output, params):
    """log_softmax of the logits after the penalties and the temperature, for each new
    token, from a forward over the whole sequence (no cache)."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(ids, torch.arange(ids.shape[1])[None])[0].float()
    out = []
    for i in range(len(output)):
        row = logits[len(prompt) + i - 1]
        seen = prompt + output[:i]
        row = apply_repetition_penalty(row, params.repetition_penalty, seen)
        row = apply_presence_frequency(row, params.presence_penalty,
                                       params.frequency_penalty, output[:i])
        t = params.temperature if params.temperature > 0 else 1.0
        out.append((row / t).log_softmax(-1))
    return out


@pytest.mark.parametrize("params", [
    greedy(8, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=10, repetition_penalty=1.3,
                   presence_penalty=0.5, frequency_penalty=0.4, seed=3, max_tokens=8,
                   logprobs=5, ignore_eos=True)])
def test_logprobs_are_log_softmax_of_what_the_sampler_used(bundled, params):
    model, tok = bundled
    llm = LLM(model, tok)
    request = llm.generate(PROMPT, params, use_tqdm=False)[0]
    out = request.outputs[0]
    ref = reference_logprobs(model, request.prompt_token_ids, out.token_ids, params)
    assert len(out.logprobs) == len(out.token_ids) == 8
    total = 0.0
    for token, entry, logp in zip(out.token_ids, out.logprobs, ref):
        assert token in entry and len(entry) in (params.logprobs, params.logprobs + 1)
        best = logp.topk(params.logprobs)
        assert [i for i in entry if entry[i].rank <= params.logprobs] == best.indices.tolist()
        for i, lp in entry.items():
            assert isinstance(lp, Logprob) and lp.logprob == pytest.approx(logp[i].item(), abs=1e-4)
            assert lp.rank == int((logp > logp[i]).sum()) + 1
            assert lp.decoded_token == tok.decode([i])
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)
    if params.greedy:  # greedy takes the best token: rank 1
        assert all(e[t].rank == 1 for t, e in zip(out.token_ids, out.logprobs))
    plain = llm.generate(PROMPT, dataclasses.replace(params, logprobs=None),
                         use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == out.token_ids  # asking for them changes no token
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_streamed_logprobs_come_with_their_tokens(bundled):
    model, tok = bundled
    engine = LLMEngine(model, tok)
    rid = engine.add_request(PROMPT, greedy(6, logprobs=0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            (answer,) = out.outputs
            assert [list(e) for e in answer.logprobs] == [answer.token_ids]  # k=0
    assert len(engine.pop(rid).logprobs) == 6


# --- presence and frequency penalties ---

def test_presence_and_frequency_penalties_follow_openais_formula():
    logits = torch.zeros(6)
    out = apply_presence_frequency(logits, 0.5, 0.25, [1, 1, 1, 4])
    assert out.tolist() == [0.0, -1.25, 0.0, 0.0, -0.75, 0.0]
    assert apply_presence_frequency(logits, 0.0, 0.0, [1]) is logits


def test_frequency_penalty_breaks_a_greedy_loop(bundled):
    model, tok = bundled
    llm = LLM(model, tok)
    plain, penalized = llm.generate(
        ["KING HENRY:\n"] * 2, [greedy(120, ignore_eos=True),
                                greedy(120, ignore_eos=True, frequency_penalty=1.0)],
        use_tqdm=False)

    def repeated(ids, n=4):
        grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
        return 1 - len(set(grams)) / len(grams)
    assert repeated(penalized.outputs[0].token_ids) < repeated(plain.outputs[0].token_ids)


# --- n > 1 ---

def test_n_answers_equal_their_seeded_solo_runs_and_fork_the_prompt(bundled):
    model, tok = bundled
    llm = LLM(model, tok, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, n=4, seed=7, max_tokens=20, logprobs=1)
    request = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [o.index for o in request.outputs] == [0, 1, 2, 3]
    for i, answer in enumerate(request.outputs):
        solo = llm.generate(PROMPT, dataclasses.replace(params, n=1, seed=7 + i),
                            use_tqdm=False)[0].outputs[0]
        assert answer.token_ids == solo.token_ids and answer.text == solo.text
        assert answer.cumulative_logprob == pytest.approx(solo.cumulative_logprob,
                                                          abs=1e-4)
    assert len({tuple(o.token_ids) for o in request.outputs}) > 1
    assert request.metrics["output_tokens"] == sum(len(o.token_ids)
                                                   for o in request.outputs)
    drained(llm.engine)


def peak_blocks(engine, prompts_params) -> int:
    ids = [engine.add_request(p, sp) for p, sp in prompts_params]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        engine.kv.blocks.check()
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free)
    for rid in ids:
        engine.pop(rid)
    return peak


def test_n_answers_share_the_prompts_blocks(bundled):
    model, tok = bundled
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4,
                       enable_prefix_caching=False)
    prompt_len = len(tok.encode(PROMPT))
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    together = peak_blocks(engine, [(PROMPT, dataclasses.replace(params, n=4))])
    apart = peak_blocks(engine, [(PROMPT, dataclasses.replace(params, seed=1 + i))
                                 for i in range(4)])
    shared = (prompt_len - 1) // 4  # the blocks before the last prompt token's
    assert apart - together == 3 * shared
    drained(engine)


def test_greedy_n_answers_are_equal_and_aborts_free_every_block(bundled):
    model, tok = bundled
    llm = LLM(model, tok)
    request = llm.generate(PROMPT, greedy(12, n=3), use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in request.outputs}) == 1
    engine = llm.engine
    rid = engine.add_request(PROMPT, greedy(50, n=3, ignore_eos=True))
    assert engine.scheduler.held  # answers 1 and 2 wait for the prompt
    aborted = engine.abort(rid)  # before anything ran
    assert [o.finish_reason for o in aborted.outputs] == ["abort"] * 3
    engine.pop(rid)
    drained(engine)
    rid = engine.add_request(PROMPT, greedy(50, n=3, ignore_eos=True))
    for _ in range(3):
        engine.step()  # forked by now
    assert len(engine.scheduler.running) == 3
    engine.abort(rid)
    assert len(engine.pop(rid)) == 3
    drained(engine)


def test_n_answers_on_the_slots_backend_run_side_by_side(bundled):
    model, tok = bundled
    llm = LLM(model, tok, kv_cache="slots", max_num_seqs=4)
    params = SamplingParams(temperature=0.9, n=3, seed=11, max_tokens=10)
    request = llm.generate("JULIET:\n", params, use_tqdm=False)[0]
    for i, answer in enumerate(request.outputs):
        solo = llm.generate("JULIET:\n", dataclasses.replace(params, n=1, seed=11 + i),
                            use_tqdm=False)[0].outputs[0]
        assert answer.token_ids == solo.token_ids
    drained(llm.engine)


def test_block_fork_counts_references_and_copies_the_partial_block():
    blocks = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    blocks.allocate("p", list(range(10)))  # positions 0..9: 3 blocks
    table = list(blocks.tables["p"])
    copy = blocks.fork("p", "c", 10)  # the child computes position 9 itself
    child = blocks.tables["c"]
    assert child[:2] == table[:2] and child[2] != table[2]
    assert copy == (table[2], child[2])  # block 2 holds positions 8 and 9: a copy
    assert blocks.ref_count[table[0]] == 2 and blocks.ref_count[table[2]] == 1
    blocks.check()
    assert blocks.fork("p", "d", 9) is None  # position 8 starts block 2: nothing to copy
    blocks.free("p")
    blocks.check()
    assert blocks.ref_count[table[0]] == 2  # the children still hold it
    with pytest.raises(ValueError, match="holds blocks"):
        blocks.fork("c", "d", 9)


def test_paged_fork_copies_the_kv_of_the_partial_block(bundled):
    model, _ = bundled
    kv = PagedKVCache.from_model(model, num_blocks=8, block_size=4,
                                 enable_prefix_caching=False)
    parent = Sequence.create(model, list(range(1, 11)), greedy(4), None, "p")
    child = Sequence.create(model, list(range(1, 11)), greedy(4), None, "c")
    kv.allocate(parent)
    for layer in kv.k + kv.v:
        layer.normal_()
    assert kv.fork(parent, child)
    src, dst = kv.blocks.tables["p"][2], kv.blocks.tables["c"][2]
    for layer in kv.k + kv.v:
        assert torch.equal(layer[dst * 4:dst * 4 + 4], layer[src * 4:src * 4 + 4])


def test_an_llm_seed_makes_unseeded_requests_repeat(bundled):
    model, tok = bundled
    params = SamplingParams(temperature=1.0, max_tokens=12)
    runs = [LLM(model, tok, seed=5).generate(["ROMEO:\n"] * 2, params, use_tqdm=False)
            for _ in range(2)]
    ids = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert ids[0] == ids[1] and ids[0][0] != ids[0][1]  # one stream of numbers
    with pytest.raises(ValueError, match="seed="):
        LLM(model, tok, seed=-1)


def test_a_stream_is_one_answer(bundled):
    with pytest.raises(ValueError, match="n=2"):
        LLM(*bundled).stream("ROMEO:\n", SamplingParams(n=2))


def test_a_seeded_llm_draws_the_same_tokens_with_cuda_graphs_on(bundled):
    """LLM(seed=7, cuda_graphs=True) once drew other tokens than LLM(seed=7), on a CPU
    too: the seed went to a wrapper, not to the runner that samples."""
    model, tok = bundled
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT, "JULIET:"]

    def ids(**kw):
        llm = LLM(model, tok, seed=7, max_num_seqs=2, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                              use_tqdm=False)]
    eager = ids()
    assert ids(cuda_graphs=True) == eager
    assert ids() == eager  # the same seed, the same tokens
    other = LLM(model, tok, seed=8, max_num_seqs=2)
    assert [o.outputs[0].token_ids for o in other.generate(prompts, params,
                                                           use_tqdm=False)] != eager
