"""minillm.engine.graphs: the graph runner gives the tokens of the eager engine. On a
CPU it runs its static, padded buffers eagerly; the capture tests need a CUDA GPU."""
import random

import pytest
import torch

from helpers import compiling, drive
from minillm.engine import LLMEngine
from minillm.engine.graphs import GraphRunner, default_buckets, enable_cuda_graphs
from minillm.sampling import SamplingParams

torch.set_num_threads(1)


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(12) == [1, 2, 4, 8, 12]
    assert default_buckets(512, 16) == [16, 32, 64, 128, 256, 512]
    for bad in (0, -3, 2.0, True, "8"):
        with pytest.raises(ValueError, match="largest"):
            default_buckets(bad)


def requests(seed: int, n: int = 10):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, 100) for _ in range(rng.randrange(0, 20))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 16),
                                ignore_eos=rng.random() < 0.5)
        out.append((rng.randrange(0, 6), prompt, params))
    return out


def serve(model, kv_cache: str, graphs: bool, arrivals, capture=False, **kw) -> list:
    """The output ids of every request, in the order they were added."""
    engine = LLMEngine(model, max_num_seqs=5, kv_cache=kv_cache, **kw)
    runner = enable_cuda_graphs(engine, capture=capture) if graphs else None
    served = drive(engine, arrivals)
    if runner is not None:
        assert runner.static and {b for b, _ in runner.static} <= {1, 2, 4, 5}
        assert len({s for _, s in runner.static}) > 1  # spans grow with the requests
    return [r.seq.output_ids for r in served.values()]


@pytest.mark.parametrize("kv_cache, kw", [("slots", {}), ("paged", {}),
                                          ("paged", dict(num_blocks=12)),
                                          ("paged", dict(enable_prefix_caching=True))])
@pytest.mark.parametrize("seed", [0, 1])
def test_static_padded_path_equals_the_eager_engine(llama, kv_cache, kw, seed):
    _, model = llama
    arrivals = requests(seed)
    assert serve(model, kv_cache, True, arrivals, **kw) == \
        serve(model, kv_cache, False, arrivals, **kw)


def test_refusals(llama):
    _, model = llama
    engine = LLMEngine(model, max_num_seqs=4)
    with pytest.raises(ValueError, match="buckets"):
        GraphRunner(engine.runner, [4, 2], [16])
    with pytest.raises(ValueError, match="spans"):
        GraphRunner(engine.runner, [1, 2], [])
    with pytest.raises(ValueError, match="CUDA device"):
        GraphRunner(engine.runner, [1, 2, 4], [16], capture=True)
    enable_cuda_graphs(engine, capture=False)
    with pytest.raises(ValueError, match="already"):
        enable_cuda_graphs(engine)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_graph_replay_equals_eager_on_the_gpu(llama, kv_cache):
    _, model = llama
    gpu = model.to("cuda")
    try:
        arrivals = requests(3)
        assert serve(gpu, kv_cache, True, arrivals, capture=None) == \
            serve(gpu, kv_cache, False, arrivals)
    finally:
        model.to("cpu")


@pytest.mark.cuda
def test_compiled_parts_inside_graphs_equal_eager_on_the_gpu(llama):
    import copy

    from minillm.engine.graphs import compile_parts
    _, model = llama
    gpu = copy.deepcopy(model).to("cuda")
    compiled = copy.deepcopy(gpu)
    arrivals = requests(4)
    with compiling():  # torch.compile really compiled: no silent fallback to eager
        compile_parts(compiled)
        got = serve(compiled, "paged", True, arrivals, capture=None)
    assert got == serve(gpu, "paged", False, arrivals)


def test_graph_runner_keeps_the_engine_usable_after_an_error(llama):
    """A bad step (here: a forward that raises) leaves no request half done."""
    _, model = llama
    engine = LLMEngine(model, max_num_seqs=4, kv_cache="paged")
    runner = enable_cuda_graphs(engine, capture=False)
    rid = engine.add_request([1, 5, 7], SamplingParams(temperature=0, max_tokens=6))
    engine.step()                                   # prefill, eager
    free = engine.kv.blocks.num_free
    real = runner.model.forward

    def broken(*a, **k):
        raise RuntimeError("boom")
    runner.model.forward = broken
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.step()
    finally:
        runner.model.forward = real
    assert engine.kv.blocks.num_free == free
    while engine.has_unfinished():
        engine.step()
    expected = LLMEngine(model, max_num_seqs=4, kv_cache="paged")
    rid2 = expected.add_request([1, 5, 7], SamplingParams(temperature=0, max_tokens=6))
    while expected.has_unfinished():
        expected.step()
    assert engine.pop(rid).output_ids == expected.pop(rid2).output_ids


def test_engine_and_llm_take_cuda_graphs(llama):
    from minillm.engine import LLM
    _, model = llama
    engine = LLMEngine(model, max_num_seqs=3, cuda_graphs=True)
    assert isinstance(engine.runner, GraphRunner)
    assert engine.runner.capture is (engine.runner.device.type == "cuda")
    assert not isinstance(LLMEngine(model, max_num_seqs=3).runner, GraphRunner)
    llm = LLM(model, max_num_seqs=3, kv_cache="slots", cuda_graphs=True)
    assert isinstance(llm.engine.runner, GraphRunner)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompts = [[1, 4, 9], [1, 16, 25, 36, 49], [1, 2]]
    eager = LLM(model, max_num_seqs=3, kv_cache="slots").generate(prompts, params,
                                                                   use_tqdm=False)
    graphs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphs] == \
        [o.outputs[0].token_ids for o in eager]
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="cuda_graphs"):
            LLMEngine(model, cuda_graphs=bad)
