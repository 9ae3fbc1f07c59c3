"""Issue 38, offline: every request's work is bounded before it starts (n, the stop
strings and stop ids), an answer that fails ends its siblings at once, a stream whose
request another caller aborted ends cleanly, LLM.chat takes the content-part lists
the server takes and hands back the templated prompt, and a config's rope_theta is
checked wherever it is written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import minillm.engine.runner as runner_module
import minillm.sampling as sampling
from helpers import greedy
from minillm.model.config import ModelConfig
from minillm.engine import LLM, LLMEngine
from minillm.model.loader import load_model
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer

torch.set_num_threads(1)
SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"
PROMPT = "ROMEO:\nBut soft, what light"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def bundled():
    return load_model(SHAKESPEARE, device="cpu"), Tokenizer.from_pretrained(SHAKESPEARE)


def several(n: int, max_tokens: int) -> SamplingParams:
    """n greedy answers of max_tokens tokens each (EOS ignored)."""
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


def drained(engine: LLMEngine) -> None:
    """Nothing queued, nothing allocated, nothing remembered."""
    assert not engine.requests and not engine.groups and not engine.group_of
    assert not getattr(engine.scheduler, "held", None)
    assert not engine.has_unfinished() and engine.kv.usage()[0] == 0
    if hasattr(engine.kv, "blocks"):
        engine.kv.blocks.check()
        assert not engine.kv.blocks.tables


# --- 1. n ---

def test_n_is_bounded_before_any_answer_is_built():
    top = sampling.MAX_N
    assert SamplingParams(n=top).n == top
    for n in (top + 1, 10**12):
        with pytest.raises(ValueError, match=rf"n={n}.*\[1, {top}\]"):
            SamplingParams(n=n)
    with pytest.raises(ValueError, match=rf"\[1, {top}\]"):
        SamplingParams(n=0)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_more_answers_than_max_num_seqs_wait_their_turn(bundled, kv_cache):
    engine = LLMEngine(*bundled, max_num_seqs=2, kv_cache=kv_cache)
    rid = engine.add_request(PROMPT, several(5, 4))
    while engine.has_unfinished():
        assert len(engine.scheduler.running) <= 2
        engine.step()
    answers = engine.pop(rid)
    assert [a.finish_reason for a in answers] == ["length"] * 5
    drained(engine)


# --- 2. stop strings and stop ids ---

def test_stop_strings_and_stop_ids_are_bounded():
    many, long = sampling.MAX_STOP_STRINGS, sampling.MAX_STOP_STRING_LEN
    ids = sampling.MAX_STOP_TOKEN_IDS
    assert len(SamplingParams(stop=[str(i) for i in range(many)]).stop) == many
    assert SamplingParams(stop="x" * long).stop == ("x" * long,)
    with pytest.raises(ValueError, match=rf"stop=.*at most {many} strings") as e:
        SamplingParams(stop=[str(i) for i in range(50_000)])
    assert len(str(e.value)) < 300  # the message shows the list's start only
    with pytest.raises(ValueError, match=rf"stop=.*at most {long} characters"):
        SamplingParams(stop=["ok", "x" * (long + 1)])
    assert len(SamplingParams(stop_token_ids=range(ids)).stop_token_ids) == ids
    with pytest.raises(ValueError, match=rf"stop_token_ids=.*at most {ids} ids"):
        SamplingParams(stop_token_ids=[5] * (ids + 1))


# --- 3. a failed answer ends its siblings ---

@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_a_failed_answer_ends_its_siblings_at_once(bundled, monkeypatch, kv_cache):
    real = runner_module.block_early_stop

    def poison(logits, seqs):  # answer 1 cannot be sampled from its third token on
        logits = real(logits, seqs).clone()
        for i, s in enumerate(seqs):
            if s.request_id == "1_r" and len(s.output_ids) >= 2:
                logits[i] = float("-inf")
        return logits
    monkeypatch.setattr(runner_module, "block_early_stop", poison)
    engine = LLMEngine(*bundled, kv_cache=kv_cache)
    engine.add_request(PROMPT, several(3, 40), request_id="r")
    engine.add_request(PROMPT, greedy(6, ignore_eos=True), request_id="other")
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
            indexes = [c.index for c in out.outputs]
            assert len(indexes) == len(set(indexes))  # one delta per answer
    assert last["r"].finished  # the step of the failure ends the whole request
    ended = {c.index: c.finish_reason for c in last["r"].outputs}
    assert ended == {0: "abort", 1: "error", 2: "abort"}
    answers = engine.pop("r")
    assert answers[1].finish_reason == "error" and "no token" in answers[1].error
    failed_at = len(answers[1].output_ids)  # none ran on to 40:
    assert all(len(a.output_ids) <= failed_at + 2 for a in answers)  # a step or two
    assert engine.pop("other").finish_reason == "length"  # the others go on
    drained(engine)


def test_generate_reports_the_failed_answer(bundled, monkeypatch):
    real = runner_module.block_early_stop

    def poison(logits, seqs):
        logits = real(logits, seqs).clone()
        for i, s in enumerate(seqs):
            if s.index == 2 and len(s.output_ids) >= 1:
                logits[i] = float("-inf")
        return logits
    monkeypatch.setattr(runner_module, "block_early_stop", poison)
    llm = LLM(*bundled)
    out = llm.generate(PROMPT, several(3, 30), use_tqdm=False)[0]
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort", "error"]
    assert out.outputs[2].error and all(len(c.token_ids) <= 3 for c in out.outputs)
    drained(llm.engine)


# --- 4. a stream whose request someone else ended ---

def test_a_stream_aborted_and_popped_elsewhere_ends_cleanly(bundled):
    llm = LLM(*bundled)
    stream = llm.stream(PROMPT, greedy(30, ignore_eos=True))
    first = next(stream)
    llm.engine.abort(stream.request_id)  # another caller ends it and forgets it
    llm.engine.pop(stream.request_id)
    rest = "".join(stream)  # no KeyError: the stream ends
    assert stream.finish_reason == "abort"
    assert len(first + rest) > 0
    assert list(stream) == []
    drained(llm.engine)


# --- 5 and 7. LLM.chat ---

def test_chat_takes_text_content_parts_and_refuses_others(bundled):
    llm = LLM(*bundled)
    plain = [{"role": "user", "content": "ROMEO: hi there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "ROMEO: hi"},
                                          {"type": "text", "text": " there"}]}]
    want = llm.chat(plain, greedy(8), use_tqdm=False, chat_template=TEMPLATE)
    got = llm.chat(parts, greedy(8), use_tqdm=False, chat_template=TEMPLATE)
    assert got[0].prompt_token_ids == want[0].prompt_token_ids
    assert got[0].outputs[0].text == want[0].outputs[0].text
    image = [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].*'image_url'.*'text'"):
        llm.chat(image, greedy(8), use_tqdm=False, chat_template=TEMPLATE)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 greedy(8), use_tqdm=False, chat_template=TEMPLATE)
    drained(llm.engine)


def test_chat_outputs_carry_the_templated_prompt(bundled):
    llm = LLM(*bundled)
    conversation = [{"role": "user", "content": "ROMEO: hi"}]
    out = llm.chat(conversation, greedy(4), use_tqdm=False, chat_template=TEMPLATE)
    text = bundled[1].apply_chat_template(conversation, add_generation_prompt=True,
                                          tokenize=False, chat_template=TEMPLATE)
    assert out[0].prompt == text == "user: ROMEO: hi\n"


# --- 6. the model's config ---

@pytest.mark.parametrize("value", [-1.0, 0, float("nan")])
def test_a_bad_rope_theta_is_refused_wherever_it_is_written(value):
    raw = json.loads((SHAKESPEARE / "config.json").read_text())
    assert "rope_theta" in raw.get("rope_parameters", {})  # written twice
    with pytest.raises(ValueError, match=r"rope_theta=.*finite number > 0"):
        ModelConfig.from_hf({**raw, "rope_theta": value})
    with pytest.raises(ValueError, match=r"rope_theta=.*finite number > 0"):
        ModelConfig(rope_theta=value)
