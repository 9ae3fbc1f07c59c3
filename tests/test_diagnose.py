"""minillm.diagnose: the chapter 8 helpers, against direct computations; bad input."""
import pytest
import torch
import transformers

from minillm.diagnose import eos_probability, input_lengths, memory_triage, repeated_share
from minillm.generate import generate
from minillm.memory import kv_cache_bytes, weight_bytes
from minillm.naive import naive_generate
from minillm.sampling import SamplingParams

torch.set_num_threads(1)
LLAMA7B = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=32, vocab_size=32000)


def test_memory_triage_adds_the_three_parts():
    parts = memory_triage(LLAMA7B, requests=16, seq_len=4096, prompt_len=4096)
    assert parts == {"weights": weight_bytes(LLAMA7B, "float16"),
                     "KV cache": kv_cache_bytes(LLAMA7B, 4096, 16, "float16"),
                     "activations": 4096 * 32000 * 4}
    assert parts["KV cache"] == 16 * 2**31  # 2 GiB per 4,096-token request
    int8 = memory_triage(LLAMA7B, 16, 4096, 4096, weight_dtype="int8")
    assert int8["weights"] * 2 == parts["weights"]


@pytest.mark.parametrize("kw, match", [(dict(prompt_len=0), "prompt_len=0"),
                                       (dict(prompt_len=True), "prompt_len=True"),
                                       (dict(requests=0), "0"),
                                       (dict(weight_dtype="int3"), "int3")])
def test_memory_triage_refuses_bad_input(kw, match):
    args = dict(requests=1, seq_len=16, prompt_len=16) | kw
    with pytest.raises(ValueError, match=match):
        memory_triage(LLAMA7B, **args)


def test_input_lengths_tells_the_cache_apart(llama):
    _, model = llama
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    with input_lengths(model) as naive:
        naive_generate(model, [1, 5, 9], params)
    with input_lengths(model) as cached:
        generate(model, [1, 5, 9], params)
    assert naive == [3, 4, 5, 6] and cached == [3, 1, 1, 1]
    with pytest.raises(RuntimeError):
        with input_lengths(model) as lengths:
            raise RuntimeError("boom")
    generate(model, [1, 5, 9], params)
    assert lengths == [] and not model._forward_pre_hooks  # the hook is gone


def test_repeated_share():
    assert repeated_share(list(range(20))) == 0
    assert repeated_share([1, 2, 3] * 10, n=3) == pytest.approx(1 - 3 / 28)
    assert repeated_share([7, 7], n=1) == 0.5
    for ids, n, match in [([1, 2], 3, "no 3-gram"), ([1], 0, "n=0"), ([1], 1.5, "n=1.5")]:
        with pytest.raises(ValueError, match=match):
            repeated_share(ids, n)


def test_eos_probability_is_the_softmax_at_eos(llama):
    _, model = llama
    prompt, answer = [1, 5, 9], [14, 22, 30, 2]
    x = torch.tensor([prompt + answer])
    with torch.inference_mode():
        logits = model(x, torch.arange(7)[None])[0]
    for t in (1.0, 0.5):
        want = (logits[2:6] / t).softmax(-1)[:, model.config.eos_token_ids].sum(-1)
        torch.testing.assert_close(eos_probability(model, prompt, answer, t), want)
    two = eos_probability(model, prompt, answer, eos_ids=[2, 14])
    torch.testing.assert_close(two, logits[2:6].softmax(-1)[:, [2, 14]].sum(-1))


@pytest.mark.parametrize("args, match", [
    (([1], []), "non-empty"), (([], [2]), "non-empty"), (([1], [10**6]), "ints in"),
    (([1], [2], 0), "temperature=0"), (([1], [2], 1.0, [-1]), "eos_ids")])
def test_eos_probability_refuses_bad_input(llama, args, match):
    _, model = llama
    with pytest.raises(ValueError, match=match):
        eos_probability(model, *args)
