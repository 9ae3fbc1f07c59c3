"""At most one read from the device per engine step (issue 26): on a GPU each read
(.item(), .tolist(), bool(tensor), .nonzero(), .cpu()) waits for every kernel queued
so far. Counted here on the CPU, where the same calls are made."""
import collections

import pytest
import torch

from minillm.engine import LLMEngine
from minillm.model.loader import load_model
from minillm.sampling import SamplingParams
from minillm.utils import bundled_model_path

READS = ("item", "tolist", "__bool__", "nonzero", "cpu", "numpy")


@pytest.fixture(scope="module")
def model():
    return load_model(bundled_model_path(), dtype=torch.float32)


def count_reads(monkeypatch, fn):
    calls = collections.Counter()
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    fn()
    monkeypatch.undo()
    return sum(calls.values()), dict(calls)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_one_device_read_per_step(model, kv_cache, monkeypatch):
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=16,
                       kv_cache=kv_cache)
    for i, temperature in enumerate([0, 0.8, 0.8]):  # greedy, seeded and unseeded
        engine.add_request([5, 6, 7 + i] * (3 + 4 * i),
                           SamplingParams(temperature=temperature, max_tokens=8,
                                          seed=i if i == 1 else None))
    steps = []
    while engine.has_unfinished():  # packed prompt chunks, mixed steps, decode steps
        steps.append(count_reads(monkeypatch, engine.step))
    assert len(steps) > 8
    assert all(n <= 1 for n, _ in steps), steps
    assert any(n == 1 for n, _ in steps)  # the counter does see the sampler's read


def test_a_nan_row_ends_alone_and_its_neighbours_keep_their_seeded_tokens(model):
    """The one read also carries which rows had NaN logits; only then are those rows
    checked one by one, and the others' draws are not repeated."""
    def run(poison):
        engine = LLMEngine(model, max_num_seqs=4, kv_cache="slots")
        ids = [engine.add_request([5, 6, 7 + i], SamplingParams(
            temperature=0.9, max_tokens=6, seed=10 + i)) for i in range(3)]
        if poison:
            real = engine.runner.sample

            def sample(seqs, logits):
                logits = logits.clone()
                for row, s in enumerate(seqs):
                    if s.request_id == ids[1]:
                        logits[row] = float("nan")
                return real(seqs, logits)
            engine.runner.sample = sample
        while engine.has_unfinished():
            engine.step()
        return [engine.pop(i) for i in ids]

    clean, poisoned = run(False), run(True)
    assert poisoned[1].finish_reason == "error" and "NaN" in poisoned[1].error
    for i in (0, 2):
        assert poisoned[i].output_ids == clean[i].output_ids
