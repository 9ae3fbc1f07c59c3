"""minillm.sampling: parameters, filters equal to transformers' logits processors, sampling
statistics, and bad input (parameters, NaN/inf logits, prev_ids) rejected with clear errors."""
import dataclasses
import re

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from minillm.sampling import NonFiniteLogitsError, SamplingParams, filter_logits, make_generator, sample

V = 200


def hf_filter(logits, prev, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0):
    """The same chain transformers' generate builds, in the same order."""
    ids = torch.as_tensor(prev)[None] if prev is not None else torch.zeros(1, 0, dtype=torch.long)
    x = logits[None].clone()
    if repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(temperature)(ids, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p:
        x = MinPLogitsWarper(min_p)(ids, x)
    return x[0]


CASES = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=10),
    dict(top_k=1),
    dict(top_p=0.9),
    dict(temperature=0.5, top_p=0.3),
    dict(min_p=0.1),
    dict(temperature=2.0, top_k=50, top_p=0.8, min_p=0.05),
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7, temperature=0.9, top_k=20),
]


@pytest.mark.parametrize("kw", CASES)
def test_filters_equal_transformers(kw):
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(V, generator=gen) * 3
        prev = torch.randint(0, V, (15,), generator=gen).tolist()
        ours = filter_logits(logits, SamplingParams(**kw), prev)
        theirs = hf_filter(logits, prev, **kw)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (kw, trial)
        kept = torch.isfinite(ours)
        torch.testing.assert_close(ours[kept], theirs[kept])
        torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 0.5])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=3))).nonzero().flatten().tolist()
    assert kept == [1, 2, 3]  # the tie at 2.0 is broken towards the lower id
    for k in (1, 5, 17, V):
        assert torch.isfinite(filter_logits(torch.randn(V), SamplingParams(top_k=k))).sum() == k


def test_top_p_boundary_token_and_ties():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log()
    for top_p, n_kept in [(0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3), (0.9, 3), (0.95, 4), (1.0, 4)]:
        ours = torch.isfinite(filter_logits(logits, SamplingParams(top_p=top_p)))
        theirs = torch.isfinite(hf_filter(logits, None, top_p=top_p))
        assert ours.sum() == n_kept == theirs.sum(), top_p
        assert torch.equal(ours, theirs)
    # tied tokens that straddle the boundary: same count and same mass as transformers; lower id first
    logits = torch.tensor([0.4, 0.3, 0.3]).log()
    ours = torch.isfinite(filter_logits(logits, SamplingParams(top_p=0.5)))
    theirs = torch.isfinite(hf_filter(logits, None, top_p=0.5))
    assert ours.tolist() == [True, True, False] and theirs.sum() == 2


def test_min_p_matches_transformers_at_ties():
    logits = torch.tensor([2.0, 2.0, 1.0, -3.0])
    ours = torch.isfinite(filter_logits(logits, SamplingParams(min_p=0.3)))
    theirs = torch.isfinite(hf_filter(logits, None, min_p=0.3))
    assert torch.equal(ours, theirs) and ours.tolist() == [True, True, True, False]


def test_greedy_is_argmax():
    logits = torch.randn(8, V)
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))
    assert sample(logits[0], SamplingParams(temperature=0)).item() == logits[0].argmax().item()
    # greedy still applies the repetition penalty (as transformers does)
    row = torch.tensor([5.0, 4.9, 0.0])
    assert sample(row, SamplingParams(temperature=0, repetition_penalty=1.2), prev_ids=[0]).item() == 1


def test_seed_reproduces_and_rows_are_independent():
    logits = torch.randn(3, V)
    ps = [SamplingParams(seed=1), SamplingParams(seed=2, top_k=5), SamplingParams(temperature=0)]
    g1 = [make_generator(p) for p in ps]
    g2 = [make_generator(p) for p in ps]
    a = torch.stack([sample(logits, ps, g1, prev_ids=[[1], [2], [3]]) for _ in range(30)])
    b = torch.stack([sample(logits, ps, g2, prev_ids=[[1], [2], [3]]) for _ in range(30)])
    assert torch.equal(a, b)
    assert torch.isin(a[:, 1], logits[1].topk(5).indices).all()
    assert (a[:, 2] == logits[2].argmax()).all()
    # a row's draws do not depend on what the other rows do
    g3 = [make_generator(ps[0])]
    c = torch.stack([sample(logits[:1], ps[:1], g3) for _ in range(30)])
    assert torch.equal(a[:, 0], c[:, 0])
    one = sample(logits, ps, [make_generator(p) for p in ps])
    assert one.shape == (3,) and one.dtype == torch.long
    assert sample(logits[0], ps[0], make_generator(ps[0])).shape == ()


# chi-square critical values at significance 0.001 for k-1 degrees of freedom (from tables)
CHI2_999 = {4: 18.467, 9: 27.877}


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_k=10), dict(top_p=0.7, temperature=1.5),
                                dict(min_p=0.2)])
def test_sampling_follows_the_filtered_distribution(kw):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(V, generator=gen)
    params = SamplingParams(seed=7, **kw)
    probs = filter_logits(logits, params).softmax(-1)
    kept = (probs > 0).nonzero().flatten()
    n = 20000
    draws = sample(logits[None].expand(n, V), params, make_generator(params))
    assert torch.isin(draws, kept).all()  # never a filtered-out token
    counts = torch.bincount(draws, minlength=V)[kept].double()
    expected = probs[kept].double() * n
    # merge the rare tokens into one bin so every expected count is >= 5
    order = expected.argsort(descending=True)
    counts, expected = counts[order], expected[order]
    big = expected >= 50
    counts = torch.cat([counts[big], counts[~big].sum()[None]]) if (~big).any() else counts
    expected = torch.cat([expected[big], expected[~big].sum()[None]]) if (~big).any() else expected
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    k = len(expected)
    critical = CHI2_999.get(k - 1) or (k - 1) + 3.1 * (2 * (k - 1)) ** 0.5  # ~ the 0.999 quantile
    assert chi2 < critical, (chi2, k)


BAD_PARAMS = [
    ("temperature", -1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", 1e-300), ("temperature", 0.001), ("temperature", 1e6), ("temperature", "0.5"),
    ("top_k", -2), ("top_k", 2.5), ("top_k", True), ("top_p", 0), ("top_p", 1.5), ("top_p", None),
    ("min_p", -0.1), ("min_p", 2), ("repetition_penalty", 0), ("repetition_penalty", 1e-300),
    ("repetition_penalty", 1e9), ("max_tokens", 0), ("max_tokens", 2.0),
    ("stop", [""]), ("stop", [None]), ("stop", b"ab"), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", "ab"), ("stop_token_ids", [1.5]), ("stop_token_ids", [True]),
    ("seed", "x"), ("seed", 2**64), ("seed", -1), ("seed", 1.0), ("ignore_eos", 1), ("ignore_eos", None),
]


@pytest.mark.parametrize("field, value", BAD_PARAMS)
def test_bad_params_name_the_field_and_the_value(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and repr(value) in str(info.value)


def test_params_are_frozen_and_replace_checks_again():
    p = SamplingParams(temperature=0.7, stop=["\n"], stop_token_ids=[3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = -1.0
    assert p.temperature == 0.7
    assert isinstance(p.stop, tuple) and isinstance(p.stop_token_ids, tuple)  # no .append
    assert dataclasses.replace(p, temperature=0).greedy
    with pytest.raises(ValueError, match=re.escape("temperature=-1")):
        dataclasses.replace(p, temperature=-1)
    assert hash(p) == hash(SamplingParams(temperature=0.7, stop="\n", stop_token_ids=(3,)))


def test_params_normalise_equivalent_inputs():
    assert SamplingParams(stop=None).stop == () == SamplingParams().stop
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)
    assert SamplingParams(stop_token_ids=np.array([4, 5])).stop_token_ids == (4, 5)
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint64(2**64 - 1))
    assert p == SamplingParams(temperature=0.5, top_k=3, seed=2**64 - 1)
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.seed) is int
    assert make_generator(p).initial_seed() == 2**64 - 1
    with pytest.raises(ValueError, match="SamplingParams"):
        make_generator({"seed": 1})


def test_tiny_top_p_keeps_the_best_token():
    # 1e-50 is a valid top_p but 0 in float32: the best token must survive anyway (as in transformers)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_p=1e-50)))
    assert kept.nonzero().flatten().tolist() == [logits.argmax().item()]
    p = SamplingParams(top_p=1e-50, seed=0)
    assert sample(logits, p, make_generator(p)).item() == logits.argmax().item()


def test_huge_top_k_keeps_everything():
    logits = torch.randn(V)
    assert torch.isfinite(filter_logits(logits, SamplingParams(top_k=10**30))).all()


SAMPLERS = {
    "greedy": SamplingParams(temperature=0),
    "greedy+penalty": SamplingParams(temperature=0, repetition_penalty=1.2),
    "sampling": SamplingParams(temperature=0.8, top_p=0.9, seed=0),
    "top_k": SamplingParams(top_k=5, seed=0),
}
POISON = {"nan": float("nan"), "+inf": float("inf")}


@pytest.mark.parametrize("poison", sorted(POISON))
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_non_finite_logits_raise_in_every_path(name, poison):
    params = SAMPLERS[name]
    logits = torch.randn(3, V)
    logits[1, 17] = POISON[poison]
    with pytest.raises(NonFiniteLogitsError, match=r"row\(s\) \[1\]"):
        sample(logits, params, make_generator(params), prev_ids=[1, 2])
    assert issubclass(NonFiniteLogitsError, ValueError)
    fine = sample(logits[[0, 2]], params, make_generator(params), prev_ids=[1, 2])  # other rows: fine
    assert fine.shape == (2,)


def test_all_minus_inf_row_raises_and_check_false_skips():
    logits = torch.randn(2, V)
    logits[0] = float("-inf")
    with pytest.raises(NonFiniteLogitsError, match=r"\[0\]"):
        sample(logits, SamplingParams(temperature=0))
    logits[0, 5] = 1.0  # one finite token is enough; -inf elsewhere is allowed
    assert sample(logits, SamplingParams(temperature=0))[0].item() == 5
    nan = torch.full((V,), float("nan"))
    assert sample(nan, SamplingParams(temperature=0), check=False).shape == ()  # no check, no error


@pytest.mark.parametrize("prev, shown", [
    ([-1], "[-1]"), ([V], f"[{V}]"), ([3, V + 7], f"[{V + 7}]"), ([[1], [V]], f"[{V}]"),
    (torch.tensor([[1, V + 2]]), f"[{V + 2}]"), (torch.tensor([-4]), "[-4]"),
    (torch.tensor([1.0, 2.0]), "float32"), (torch.tensor([True]), "bool"), ([True], "[True]"),
    ([1.5], "[1.5]"), ("12", "'12'"), (np.array([V]), f"[{V}]"),
])
@pytest.mark.parametrize("name", ["greedy", "greedy+penalty", "sampling"])
def test_prev_ids_must_be_token_ids(name, prev, shown):
    params = SAMPLERS[name]
    per_row = isinstance(prev, list) and isinstance(prev[0], list)
    logits = torch.randn(len(prev) if per_row else 1, V)
    with pytest.raises(ValueError) as info:
        sample(logits, params, make_generator(params), prev_ids=prev)
    assert shown in str(info.value) and "prev_ids" in str(info.value)
    if name != "greedy":
        with pytest.raises(ValueError, match="prev_ids"):
            filter_logits(logits, params, prev)


@pytest.mark.parametrize("logits, shown", [
    (torch.zeros(2, 3, V), "(2, 3, 200)"), (torch.zeros(V, dtype=torch.long), "(200,)"),
    (torch.zeros(1, 0), "(1, 0)"), ([0.1, 0.2], "list"),
])
def test_bad_logits(logits, shown):
    with pytest.raises(ValueError, match=re.escape(shown)):
        sample(logits, SamplingParams())


@pytest.mark.parametrize("empty", [[], (), torch.tensor([], dtype=torch.long), [[], []]])
def test_empty_prev_ids_mean_no_history(empty):
    logits = torch.randn(2, V)
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert torch.equal(sample(logits, p, prev_ids=empty), logits.argmax(-1))


def test_params_must_be_sampling_params():
    with pytest.raises(ValueError, match="dict"):
        sample(torch.randn(V), {"temperature": 0})


def test_stop_string_is_wrapped_in_a_list():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


def test_batch_size_mismatch():
    with pytest.raises(ValueError, match="params"):
        sample(torch.randn(2, V), [SamplingParams()] * 3)
