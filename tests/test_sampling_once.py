"""Issue 37: a step computes the penalties and the temperature once, even when a request
asks for logprobs too: the draw and the logprobs read the same scaled logits. The tokens
and logprobs are those of the old way (sample, then a second penalty pass for logprobs),
bit for bit, on the bundled model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minillm import sampling
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.runner import ModelRunner
from minillm.model.loader import load_model
from minillm.sampling import SamplingParams, filter_logits, sample
from minillm.tokenizer import Tokenizer

SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"
PROMPT = "ROMEO:\nWhat light through yonder window breaks? It is the east"
PENALIZED = SamplingParams(temperature=0.7, top_k=10, repetition_penalty=1.3,
                           presence_penalty=0.5, frequency_penalty=0.4, seed=3,
                           max_tokens=8, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def bundled():
    return load_model(SHAKESPEARE, device="cpu"), Tokenizer.from_pretrained(SHAKESPEARE)


def count_penalties(monkeypatch) -> dict[str, int]:
    """Count the calls of the two penalty functions (sampling's globals: every caller
    reaches them through the module)."""
    calls = {"repetition": 0, "presence_frequency": 0}
    for key, name in [("repetition", "apply_repetition_penalty"),
                      ("presence_frequency", "apply_presence_frequency")]:
        real = getattr(sampling, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(sampling, name, counted)
    return calls


def old_draw(self, logits, params, generators, history, outputs):
    """The old composition: `sample` (penalties inside), then a second penalty pass
    for what logprobs report."""
    ids = sample(logits, params, generators, prev_ids=history, check=False,
                 output_ids=outputs)
    if not any(p.logprobs is not None for p in params):
        return ids, None
    prev = [None] * len(params) if history is None else history
    return ids, sampling._scale(logits.float(), params, prev, outputs)


def run(model, tok, requests) -> tuple[dict, list[int]]:
    """Step an engine through `requests` [(prompt, params)]: each answer's ids and
    logprobs by request id, and the number of rows sampled in each step."""
    engine = LLMEngine(model, tok, max_num_seqs=4, max_model_len=128)
    order = {engine.add_request(prompt, params): i
             for i, (prompt, params) in enumerate(requests)}
    answers, rows = {}, []
    while engine.has_unfinished():
        outs = engine.step()
        rows.append(sum(len(o.outputs) for o in outs))
        for o in outs:
            for c in o.outputs:
                ids, lps = answers.setdefault((order[o.request_id], c.index),
                                              ([], []))
                ids += c.token_ids
                lps += [{t: (lp.logprob, lp.rank) for t, lp in e.items()}
                        for e in c.logprobs or []]
    return answers, rows


def test_one_step_computes_the_penalties_once(bundled, monkeypatch):
    model, tok = bundled
    engine = LLMEngine(model, tok, max_num_seqs=2, max_model_len=128)
    engine.add_request(PROMPT, PENALIZED)
    calls = count_penalties(monkeypatch)
    steps = 0
    while engine.has_unfinished():
        before = dict(calls)
        outs = engine.step()
        if not outs:
            continue
        steps += 1
        assert outs[0].outputs[0].logprobs  # logprobs asked and reported
        assert calls["repetition"] - before["repetition"] == 1  # once per step
        assert calls["presence_frequency"] - before["presence_frequency"] == 1
    assert steps == PENALIZED.max_tokens


def test_the_tokens_and_logprobs_equal_the_old_composition(bundled, monkeypatch):
    model, tok = bundled
    requests = [(PROMPT, PENALIZED),
                ("JULIET:\nO Romeo", SamplingParams(temperature=0, logprobs=3,
                                                     max_tokens=6, ignore_eos=True)),
                ("KING:\nSpeak", SamplingParams(temperature=0.9, top_p=0.9, seed=11,
                                                repetition_penalty=1.2, max_tokens=7,
                                                ignore_eos=True)),
                ("HAMLET:\nTo be", SamplingParams(temperature=0.8, min_p=0.05, n=2,
                                                  seed=5, frequency_penalty=0.3,
                                                  logprobs=2, max_tokens=5,
                                                  ignore_eos=True))]
    torch.manual_seed(0)
    new, new_rows = run(model, tok, requests)
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "_draw", old_draw)
        torch.manual_seed(0)
        old, old_rows = run(model, tok, requests)
    assert new_rows == old_rows
    assert new == old  # the same ids, the same logprobs and ranks, exactly
    assert all(len(ids) for ids, _ in new.values())
    assert len(new[(0, 0)][1]) == PENALIZED.max_tokens  # logprobs: every token


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_draws_from_the_filtered_distribution_bit_for_bit(seed):
    """`sample`'s two steps (scale, then filter and draw) equal the old one-piece
    way: filter_logits, then one multinomial draw with the same generator."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 50, generator=g) * 3
    prev = [torch.randint(0, 50, (7,), generator=g) for _ in range(4)]
    params = [SamplingParams(temperature=0.7, top_k=12, repetition_penalty=1.4,
                             presence_penalty=0.3, frequency_penalty=0.2),
              SamplingParams(temperature=0, repetition_penalty=1.2),
              SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02),
              SamplingParams(temperature=0.5, frequency_penalty=1.0)]
    ours = sample(logits, params, torch.Generator().manual_seed(seed), prev_ids=prev,
                  output_ids=prev)
    filtered = filter_logits(logits, params, prev_ids=prev, output_ids=prev)
    drawn = torch.multinomial(filtered.softmax(-1), 1,
                              generator=torch.Generator().manual_seed(seed))[:, 0]
    theirs = torch.where(torch.tensor([p.greedy for p in params]),
                         filtered.max(-1).indices, drawn)
    assert torch.equal(ours, theirs)
