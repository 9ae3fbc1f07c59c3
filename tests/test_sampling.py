"""minillm.sampling: parameters, filters equal to transformers' logits processors, sampling statistics."""
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from minillm.sampling import SamplingParams, filter_logits, make_generator, sample

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
    # transformers keeps every token tied with the k-th one
    assert torch.isfinite(TopKLogitsWarper(3)(None, logits[None])).sum() == 4
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
    draw = lambda: torch.stack([sample(logits, ps, [make_generator(p) for p in ps]) for _ in range(1)])
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
    assert draw().shape == (1, 3)


# chi-square critical values at significance 0.001 for k-1 degrees of freedom (from tables)
CHI2_999 = {4: 18.467, 9: 27.877}


@pytest.mark.parametrize("kw, dof", [(dict(temperature=0.8, top_k=10), 9), (dict(top_p=0.7, temperature=1.5), None),
                                     (dict(min_p=0.2), None)])
def test_sampling_follows_the_filtered_distribution(kw, dof):
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


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="x"), "seed"), (dict(ignore_eos=1), "ignore_eos"),
])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_stop_string_is_wrapped_in_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]


def test_batch_size_mismatch():
    with pytest.raises(ValueError, match="params"):
        sample(torch.randn(2, V), [SamplingParams()] * 3)
