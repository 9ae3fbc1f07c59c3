"""SamplingParams.min_tokens: no EOS, stop id or stop string before that many new
tokens, in every loop of the book, the same ids as transformers' min_tokens."""
import dataclasses

import pytest
import torch

from helpers import drive, greedy, hf_greedy
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.model.naive import naive_generate
from minillm.sampling import SamplingParams
from minillm.sequence import Sequence, block_early_stop

torch.set_num_threads(1)
PROMPT = [1, 5, 9, 14]


@pytest.mark.parametrize("value", [-1, 1.5, "3", True, None, 11])
def test_bad_values_are_refused_with_the_allowed_range(value):
    with pytest.raises(ValueError, match=r"min_tokens=.* must be an int in \[0, "
                                         r"max_tokens=10\]"):
        SamplingParams(max_tokens=10, min_tokens=value)


def test_default_is_off_and_numpy_ints_become_ints():
    import numpy as np
    assert SamplingParams().min_tokens == 0
    p = SamplingParams(max_tokens=8, min_tokens=np.int64(8))
    assert p.min_tokens == 8 and type(p.min_tokens) is int
    with pytest.raises(ValueError, match="min_tokens"):
        dataclasses.replace(p, max_tokens=4)  # replace runs the checks again


@pytest.fixture(scope="module")
def early(llama):
    """The llama pair, with an EOS that greedy decoding reaches after 3 tokens."""
    hf, model = llama
    free = generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True))
    eos = free[3]
    saved = list(model.config.eos_token_ids)
    model.config.eos_token_ids = [eos]
    yield hf, model, eos, free
    model.config.eos_token_ids = saved


@pytest.mark.parametrize("m", [0, 1, 4, 9, 24])
def test_every_loop_equals_transformers_min_tokens(early, m):
    hf, model, eos, free = early
    params = greedy(24, min_tokens=m)
    ours = generate(model, PROMPT, params)
    assert naive_generate(model, PROMPT, params) == ours
    assert ours == hf_greedy(hf, PROMPT, 24, eos_token_id=eos, min_new_tokens=m)
    first_eos = ours.index(eos) if eos in ours else len(ours)
    assert first_eos >= m  # none of the first m tokens is EOS
    if m == 0:
        assert ours == free[:free.index(eos) + 1]  # the symptom: an answer of 4 tokens
    for kv_cache in ("paged", "slots"):  # chapters 6 and 4
        engine = LLMEngine(model, max_num_seqs=4, kv_cache=kv_cache)
        served = drive(engine, [(0, PROMPT, params)] * 3)
        assert [r.seq.output_ids for r in served.values()] == [ours] * 3


def test_stop_ids_and_stop_strings_wait_too(early):
    _, model, eos, free = early
    stop = free[1]
    ours = generate(model, PROMPT, greedy(24, min_tokens=5, ignore_eos=True,
                                          stop_token_ids=[stop]))
    assert stop not in ours[:5] and len(ours) > 5

    class Letters:  # one letter per id
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)
    text = Letters().decode(free)
    params = greedy(24, min_tokens=6, ignore_eos=True, stop=[text[2]])
    out = generate(model, PROMPT, params, tokenizer=Letters())
    assert len(out) > 6 and text[2] in Letters().decode(out)[6:]


def test_block_early_stop_masks_only_rows_that_must_go_on(early):
    _, model, eos, _ = early
    a = Sequence.create(model, PROMPT, greedy(10, min_tokens=2))
    b = Sequence.create(model, PROMPT, greedy(10, min_tokens=0))
    logits = torch.zeros(2, model.config.vocab_size)
    assert block_early_stop(logits, [b, b]) is logits  # nothing to do: no copy
    out = block_early_stop(logits, [a, b])
    assert out[0, eos] == float("-inf") and torch.isfinite(out[1]).all()
    assert torch.isfinite(logits).all()  # the input is not changed
    a.append(7), a.append(8)
    assert torch.isfinite(block_early_stop(logits, [a, b])).all()
