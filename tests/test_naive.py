"""minillm.model.naive: the naive loop against transformers' generate, stopping rules, bad input."""
import copy
import re

import numpy as np
import pytest
import torch
import transformers

from helpers import hf_greedy, make_model_pair
from minillm.model.loader import load_model
from minillm.model.naive import naive_generate
from minillm.sampling import NonFiniteLogitsError, SamplingParams
from minillm.perf import timing
from minillm.perf.timing import median_time, time_per_token
from minillm.utils import bundled_model_path

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model_pair(tmp_path_factory.mktemp("tiny"), "llama_gqa_untied", "init",
                           vocab_size=97, intermediate_size=128, max_position_embeddings=64)


@pytest.mark.parametrize("prompt", [[1], [1, 50, 3, 77, 8], list(range(5, 30))])
def test_greedy_equals_transformers_generate(tiny, prompt):
    hf, model = tiny
    ours = naive_generate(model, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(ours) == 20
    assert ours == hf_greedy(hf, prompt, 20, eos_token_id=None)


def test_greedy_with_repetition_penalty_equals_transformers(tiny):
    hf, model = tiny
    ours = naive_generate(model, [1, 4, 4, 9], SamplingParams(temperature=0, max_tokens=15, ignore_eos=True,
                                                              repetition_penalty=1.5))
    assert ours == hf_greedy(hf, [1, 4, 4, 9], 15, eos_token_id=None, repetition_penalty=1.5)


def test_stops_on_eos_and_stop_ids(tiny):
    hf, model = tiny
    free = naive_generate(model, [1, 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_at = free[4]
    first = free.index(stop_at)
    out = naive_generate(model, [1, 5], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))
    assert out == free[:first + 1]
    model.config.eos_token_ids = [stop_at]  # the model's own EOS, unless ignore_eos
    try:
        assert naive_generate(model, [1, 5], SamplingParams(temperature=0, max_tokens=12)) == free[:first + 1]
        assert naive_generate(model, [1, 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) == free
    finally:
        model.config.eos_token_ids = [2]


class LetterTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_need_and_use_a_tokenizer(tiny):
    _, model = tiny
    free = naive_generate(model, [1, 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    text = LetterTokenizer().decode(free)
    target = text[5:7]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[target])
    out = naive_generate(model, [1, 5], params, tokenizer=LetterTokenizer())
    assert target in LetterTokenizer().decode(out) and target not in LetterTokenizer().decode(out[:-1])
    with pytest.raises(ValueError, match="tokenizer"):
        naive_generate(model, [1, 5], params)
    with pytest.raises(ValueError, match="tokenizer='abc'"):
        naive_generate(model, [1, 5], params, tokenizer="abc")  # has no .decode


def test_seeded_sampling_reproduces(tiny):
    _, model = tiny
    p = SamplingParams(temperature=1.0, top_k=20, max_tokens=15, seed=123, ignore_eos=True)
    a, b = naive_generate(model, [1, 7], p), naive_generate(model, [1, 7], p)
    assert a == b
    c = naive_generate(model, [1, 7], SamplingParams(temperature=1.0, top_k=20, max_tokens=15, seed=124,
                                                     ignore_eos=True))
    assert c != a


@pytest.mark.parametrize("prompt, kw, shown", [
    ([], {}, "empty"),
    ([1] * 60, dict(max_tokens=5), "65 exceeds the model's context of 64"),
    ([1, 500], {}, "[500]"),
    ([1, -3], {}, "[-3]"),
    ([1, 97], {}, "[97]"),                                   # vocab is 97: ids are 0..96
    ([1, True], {}, "[True]"),
    ([1, 2.0], {}, "[2.0]"),
    ([1, "2"], {}, "['2']"),
    ([[1, 2], [3, 4]], {}, "[[1, 2], [3, 4]]"),              # a batch as nested lists
    (torch.tensor([[1, 2], [3, 4]]), {}, "shape (2, 2)"),  # a batch: was silently flattened
    (torch.tensor([[1, 2]]), {}, "shape (1, 2)"),
    (torch.tensor(5), {}, "shape ()"),
    (torch.tensor([1.0, 2.0]), {}, "torch.float32"),
    (torch.tensor([True, False]), {}, "torch.bool"),
    (np.array([1.0, 2.0]), {}, "torch.float64"),
    (np.array([True]), {}, "torch.bool"),
    (np.array([[1, 2]]), {}, "shape (1, 2)"),
    (b"\x01\x05", {}, "bytes"),
    ("ROMEO", {}, "'ROMEO'"),
    ({1, 2}, {}, "set"),
    (None, {}, "NoneType"),
    (iter([1, 2]), {}, "list_iterator"),
    ([1, 5], dict(stop_token_ids=[97]), "stop_token_ids [97]"),
])
def test_bad_input_fails_before_running(tiny, prompt, kw, shown, monkeypatch):
    _, model = tiny
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(ValueError) as info:
        naive_generate(model, prompt, SamplingParams(**kw))
    assert shown in str(info.value), str(info.value)


def test_params_must_be_sampling_params(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="dict"):
        naive_generate(model, [1, 2], {"temperature": 0})


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=5),
                                    SamplingParams(temperature=0.8, top_k=10, max_tokens=5, seed=1)],
                         ids=["greedy", "sampling"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_broken_weights_raise_instead_of_token_zero(tiny, params, poison):
    _, model = tiny
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.layers[1].mlp.down_proj.weight[3, 5] = poison
    with pytest.raises(NonFiniteLogitsError, match="NaN or inf"):
        naive_generate(broken, [1, 5, 6], params)


def test_numpy_and_tensor_prompts(tiny):
    import numpy as np
    _, model = tiny
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = naive_generate(model, [1, 5, 6], p)
    assert naive_generate(model, np.array([1, 5, 6]), p) == ref
    assert naive_generate(model, torch.tensor([1, 5, 6]), p) == ref


class FakeClock:
    """perf_counter that only moves when the code under test does work."""
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_median_time_warms_up_repeats_and_takes_the_median(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    costs = iter([100.0, 100.0, 3.0, 1.0, 2.0])  # two warm-up calls (slow), then three timed ones
    calls = []
    def work():
        calls.append(1)
        clock.now += next(costs)
    assert median_time(work, warmup=2, repeats=3) == 2.0
    assert len(calls) == 5


@pytest.mark.parametrize("kw, shown", [(dict(repeats=0), "repeats=0"), (dict(warmup=-1), "warmup=-1"),
                                       (dict(repeats=2.0), "repeats=2.0"), (dict(warmup=True), "warmup=True")])
def test_median_time_rejects_bad_counts(kw, shown):
    calls = []
    with pytest.raises(ValueError, match=re.escape(shown)):
        median_time(lambda: calls.append(1), **kw)
    assert calls == []


def test_time_per_token_times_each_position(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    seen = []
    def step(n):
        seen.append(n)
        clock.now += n / 1000
    assert time_per_token(step, [10, 1000, 40], warmup=1, repeats=3, progress=False) == pytest.approx(
        [0.01, 1.0, 0.04])
    assert seen == [10] * 4 + [1000] * 4 + [40] * 4


def test_bundled_model_greedy_equals_transformers():
    folder = bundled_model_path()
    assert (folder / "config.json").is_file(), f"the bundled model is missing from {folder}"
    model = load_model(folder, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [model.config.bos_token_id or 0] + list(range(10, 20))
    ours = naive_generate(model, prompt, SamplingParams(temperature=0, max_tokens=24))
    eos = model.config.eos_token_ids or None
    assert ours == hf_greedy(hf, prompt, 24, eos_token_id=eos)
