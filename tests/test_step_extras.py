"""Chapter 4's STEP_EXTRAS: a later chapter's per-request input reaches the model at every
token, in meta.extras, laid out as positions, on every way a step runs: eager (packed
prefills and decode rows), chapter 7's static buffers (padding rows hold 0), appendix
7a's compiled step, and chapter 13's workers (it travels with the step)."""
from __future__ import annotations

import pytest
import torch

from minillm.engine import LLMEngine
from minillm.engine.llm_engine import REQUEST_EXTRAS
from minillm.engine.runner import STEP_EXTRAS
from minillm.model.loader import load_model
from minillm.model.transformer import StepMeta
from minillm.parallel.workers import pack_step, unpack_step
from minillm.sampling import SamplingParams
from minillm.utils import bundled_model_path

torch.set_num_threads(1)
FORCED = 7  # the token a request with probe=1 always gets
PROMPTS = [[1, 5, 9, 13, 17], [1, 30, 31, 32], [1, 40, 41], [1, 50, 51, 52, 53, 54]]


@pytest.fixture
def probe(monkeypatch):
    """add_request(..., probe=1) and a step extra "probe"; the model's logits favour
    FORCED on each token whose probe is 1 (so a request's tokens show what its rows
    got)."""
    monkeypatch.setitem(REQUEST_EXTRAS, "probe", int)
    monkeypatch.setitem(STEP_EXTRAS, "probe", lambda seq: seq.extras.get("probe", 0))

    def bump(module, args, kwargs, logits):
        meta = kwargs["meta"]
        probe = meta.extras["probe"]
        if meta.query_start_loc is not None:  # packed: one row per request's last
            probe = probe[0, meta.logits_index][:, None]
        elif meta.logits_index is not None:
            probe = probe.gather(1, meta.logits_index.view(-1, 1))
        onehot = torch.nn.functional.one_hot(torch.tensor(FORCED), logits.shape[-1])
        return logits + 1e4 * (probe[..., None] == 1) * onehot

    model = load_model(str(bundled_model_path()), dtype=torch.float32)
    model.register_forward_hook(bump, with_kwargs=True)
    return model


def run(engine, probes) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    rids = [engine.add_request(p, params, probe=k) for p, k in zip(PROMPTS, probes)]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop(r).output_ids for r in rids]


@pytest.mark.parametrize("options", [{}, {"cuda_graphs": True},
                                     {"compile_decode": True}],
                         ids=["eager", "static buffers", "compiled"])
def test_each_request_gets_its_own_value_at_every_token(probe, options):
    engine = LLMEngine(probe, max_num_seqs=4, max_model_len=64, **options)
    plain = run(engine, [0, 0, 0, 0])
    assert all(FORCED not in t for t in plain)  # the bump alone makes FORCED
    mixed = run(engine, [1, 0, 1, 0])  # batched together: prefill and decode rows
    assert mixed == [[FORCED] * 5, plain[1], [FORCED] * 5, plain[3]]
    if options:
        assert engine.runner.forward.used  # the steps went through its buckets


def test_without_a_registered_extra_a_step_carries_none():
    model = load_model(str(bundled_model_path()), dtype=torch.float32)
    seen = []
    model.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(dict(kwargs["meta"].extras)),
        with_kwargs=True)
    engine = LLMEngine(model, max_num_seqs=2, max_model_len=64)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert seen == [{}, {}]  # a prefill and a decode step, nothing extra


def test_the_extras_travel_to_a_worker():
    extras = {"probe": torch.tensor([[1], [0]])}
    meta = StepMeta(positions=torch.tensor([[4], [6]]), extras=extras)
    *_, got = unpack_step(pack_step(torch.tensor([[1], [2]]), meta.positions, None,
                                    meta), torch.device("cpu"))
    assert set(got.extras) == {"probe"}
    assert torch.equal(got.extras["probe"], extras["probe"])
