"""minillm.engine.graphs: the graph forward gives the tokens of the eager engine. On a
CPU it runs its static, padded buffers eagerly; the capture tests need a CUDA GPU."""
import random

import pytest
import torch

from helpers import compiling, drive
from minillm.engine import LLMEngine
from minillm.engine.graphs import GraphForward, default_buckets
from minillm.sampling import SamplingParams

torch.set_num_threads(1)


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(12) == [1, 2, 4, 8, 12]
    assert default_buckets(512, 16) == [16, 32, 64, 128, 256, 512]
    assert default_buckets(512, 16, factor=4) == [16, 64, 256, 512]
    for bad in (0, -3, 2.0, True, "8"):
        with pytest.raises(ValueError, match="largest"):
            default_buckets(bad)
    for bad in (1, 0, 2.5):
        with pytest.raises(ValueError, match="factor"):
            default_buckets(8, factor=bad)


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
    engine = LLMEngine(model, max_num_seqs=5, kv_cache=kv_cache,
                       cuda_graphs={"capture": capture} if graphs else None, **kw)
    runner = engine.runner.forward if graphs else None
    served = drive(engine, arrivals)
    if runner is not None:
        assert runner.used and {b for b, _, _ in runner.used} <= {1, 2, 4, 5}
        assert len({s for _, s, _ in runner.used}) > 1  # spans grow with requests
        assert runner.replays == (sum(runner.used.values()) if runner.capture else 0)
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
        GraphForward(model, engine.kv, [4, 2], [16])
    with pytest.raises(ValueError, match="spans"):
        GraphForward(model, engine.kv, [1, 2], [])
    with pytest.raises(ValueError, match="CUDA device"):
        GraphForward(model, engine.kv, [1, 2, 4], [16], capture=True)
    for bad in ({"bucket": [1]}, {"buckets": "1"}, {"capture": 1}, [1, 2]):
        with pytest.raises(ValueError, match="cuda_graphs"):
            LLMEngine(model, max_num_seqs=4, cuda_graphs=bad)


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
def test_graphs_are_captured_and_replayed(llama, monkeypatch):
    """On a GPU: every bucket is a graph once the engine is built, its time and
    memory reported; each decode step replays one (cudaGraphLaunch in the profiler)
    and nothing is recorded while serving."""
    from torch.profiler import ProfilerActivity, profile
    _, model = llama
    gpu = model.to("cuda")
    try:
        engine = LLMEngine(gpu, max_num_seqs=4, kv_cache="paged", cuda_graphs=True)
        runner = engine.runner.forward
        assert len(runner.graphs) == len(runner.buckets) * len(runner.spans)
        assert runner.capture_seconds > 0 and runner.capture_bytes > 0
        monkeypatch.setattr(runner, "_capture", lambda key: pytest.fail(
            f"recorded {key} while serving"))
        for i in range(3):
            engine.add_request([1, 5 + i, 9], SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True))
        engine.step()  # the prefill, eager
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            engine.step()
            torch.cuda.synchronize()
        launches = {e.key: e.count for e in p.key_averages()}
        assert launches.get("cudaGraphLaunch", 0) == 1
        while engine.has_unfinished():
            engine.step()
        assert runner.replays == sum(runner.used.values()) >= 11
    finally:
        model.to("cpu")


@pytest.mark.cuda
def test_graphs_refuse_a_model_compiled_with_its_own_graphs(llama):
    import copy

    from minillm.engine.graphs import compile_parts
    _, model = llama
    gpu = copy.deepcopy(model).to("cuda")
    compile_parts(gpu, mode="reduce-overhead")
    with pytest.raises(ValueError, match="reduce-overhead"):
        LLMEngine(gpu, max_num_seqs=2, cuda_graphs=True)


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


def test_every_bucket_is_recorded_up_front_largest_first(llama, monkeypatch):
    """capture_all records each (batch bucket, span) once, the largest first, and
    reports it; serving afterwards records nothing (here: the recording is stubbed,
    as a CPU cannot record; on a GPU test_graphs_are_captured_and_replayed)."""
    _, model = llama
    engine = LLMEngine(model, max_num_seqs=4, kv_cache="paged")
    runner = GraphForward(model, engine.kv, [1, 2, 4], [16, 32])
    recorded = []
    monkeypatch.setattr(runner, "_capture", lambda key: (
        recorded.append(key), runner.graphs.__setitem__(key, object())))
    report = runner.capture_all()
    assert recorded == [(4, 32, 1), (4, 16, 1), (2, 32, 1), (2, 16, 1), (1, 32, 1),
                        (1, 16, 1)]
    assert report.startswith("captured 6 CUDA graphs in ")
    assert runner.capture_all() and len(recorded) == 6  # nothing twice


def test_the_number_of_graphs_is_bounded(llama):
    _, model = llama
    def graphs(max_num_seqs, **settings):
        return LLMEngine(model, max_num_seqs=max_num_seqs, kv_cache="paged",
                         num_blocks=64, cuda_graphs={"capture": False, **settings})
    engine = graphs(256)
    assert engine.max_model_len == 128
    assert len(engine.runner.forward.spans) == 4  # 16 ... 128
    runner = graphs(256, max_graphs=32).runner.forward
    assert runner.buckets == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert runner.spans == [16, 64, 128]  # 9 x 4 > 32: the spans grow by 4x
    runner = graphs(256, max_graphs=20).runner.forward  # 9 x 3 > 20 too: 8x
    assert runner.spans == [16, 128] and len(runner.buckets) * 2 <= 20
    with pytest.raises(ValueError, match="4 batch buckets x 8 spans = 32 graphs"):
        graphs(8, spans=default_buckets(2048, 16), max_graphs=16)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_graphs"):
            graphs(8, max_graphs=bad)


def test_what_cannot_live_in_a_graph_is_named(llama):
    import copy

    from minillm.engine.graphs import compile_parts, graph_blockers
    _, model = llama
    assert graph_blockers(model) is None
    fake = copy.deepcopy(model)
    Linear8bitLt = type("Linear8bitLt", (torch.nn.Linear,),
                        {"__module__": "bitsandbytes.nn.modules"})
    fake.layers[0].mlp.down_proj = Linear8bitLt(4, 4)
    assert "layers.0.mlp.down_proj is a bitsandbytes layer" in graph_blockers(fake)
    compiled = copy.deepcopy(model)
    compile_parts(compiled, mode="reduce-overhead")  # compiles on first call only
    assert "mode='reduce-overhead'" in graph_blockers(compiled)
    fine = copy.deepcopy(model)
    compile_parts(fine, mode="max-autotune-no-cudagraphs")
    assert graph_blockers(fine) is None


def test_graph_forward_keeps_the_engine_usable_after_an_error(llama):
    """A bad step (here: a forward that raises) leaves no request half done."""
    _, model = llama
    engine = LLMEngine(model, max_num_seqs=4, kv_cache="paged",
                       cuda_graphs={"capture": False})
    runner = engine.runner.forward
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
    assert isinstance(engine.runner.forward, GraphForward)
    assert engine.runner.forward.capture is (engine.runner.device.type == "cuda")
    assert not isinstance(LLMEngine(model, max_num_seqs=3).runner.forward,
                          GraphForward)
    llm = LLM(model, max_num_seqs=3, kv_cache="slots", cuda_graphs=True)
    assert isinstance(llm.engine.runner.forward, GraphForward)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompts = [[1, 4, 9], [1, 16, 25, 36, 49], [1, 2]]
    eager = LLM(model, max_num_seqs=3, kv_cache="slots").generate(prompts, params,
                                                                   use_tqdm=False)
    graphs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphs] == \
        [o.outputs[0].token_ids for o in eager]
    for bad in (1, "yes", {"spans": [0]}):
        with pytest.raises(ValueError, match="cuda_graphs"):
            LLMEngine(model, cuda_graphs=bad)
    # None is what leaving the option out gives every registered option: off
    assert not isinstance(LLMEngine(model, cuda_graphs=None).runner.forward,
                          GraphForward)
