"""The runner is built from parts (issue 70, part 1): each option returns its part
(a forward, a speculator, a logits processor) or changes the model in place; no option
replaces the runner, wraps it in a proxy or sets an attribute the engine does not
declare; speculation verifies through the same forward as decode."""
import ast
import pathlib

import pytest
import torch

import minillm
from minillm.engine import LLMEngine
from minillm.engine.compiled import CompiledForward
from minillm.engine.graphs import GraphForward
from minillm.engine.runner import Forward
from minillm.sampling import SamplingParams

torch.set_num_threads(1)
PACKAGE = pathlib.Path(minillm.__file__).parent
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}


def assignments_to(attribute: str) -> list[str]:
    """The files of every `<something>.<attribute> = ...` in the package, once each."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == attribute:
                    found.append(str(path.relative_to(PACKAGE)))
    return found


def test_no_option_replaces_the_runner_or_proxies_it():
    # the engine builds its runner once; the draft model's proposer owns its own
    assert sorted(assignments_to("runner")) == [
        "engine/llm_engine.py", "speculative/proposers.py"]
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        proxies = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                   and n.name in ("__getattr__", "__setattr__")]
        allowed = {"speculative/proposers.py": ["__getattr__"],  # Drafted: a view of a request
                   "engine/__init__.py": ["__getattr__"],  # lazy module attributes
                   "__init__.py": ["__getattr__"],  # minillm's front door
                   "model/__init__.py": ["__getattr__"],  # the names the old module had
                   "quant/__init__.py": ["__getattr__"],
                   "perf/__init__.py": ["__getattr__"]}
        assert proxies == allowed.get(str(path.relative_to(PACKAGE)), []), path


def test_options_set_no_attribute_the_engine_does_not_declare(llama):
    _, model = llama
    plain = LLMEngine(model, max_num_seqs=2, max_model_len=64, kv_cache="paged")
    full = LLMEngine(model, max_num_seqs=2, max_model_len=64, kv_cache="paged",
                     cuda_graphs={"capture": False}, speculative_config=NGRAM,
                     structured_outputs_config={"backend": "minillm"})
    assert vars(full).keys() == vars(plain).keys()
    assert vars(full.runner).keys() == vars(plain.runner).keys()
    assert type(plain.runner.forward) is Forward and plain.runner.speculator is None
    assert isinstance(full.runner.forward, GraphForward)
    assert type(full.runner.speculator).__name__ == "Speculator"
    assert [type(p).__name__ for p in full.runner.logits_processors] == [
        "function", "StructuredOutputManager"]  # min_tokens, then chapter 11's


def serve(engine) -> list:
    """Two prompts that repeat themselves (prompt lookup finds drafts), served
    together: their output ids."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rids = [engine.add_request([1] + [5, 6, 7, 8] * (3 + i), params)
            for i in range(2)]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop(r).output_ids for r in rids]


def test_a_compiled_speculating_engine_verifies_through_the_compiled_forward(llama):
    """After a warm-up run, the second run's only eager forwards are its prefills:
    every decode and every verify step goes through a compiled bucket, verify steps as
    rows of k + 1 tokens; the tokens are the eager engine's."""
    _, model = llama
    engine = LLMEngine(model, max_num_seqs=2, max_model_len=64, kv_cache="paged",
                       compile_decode={"buckets": [2], "spans": [64]},
                       speculative_config=NGRAM)
    forward, stats = engine.runner.forward, engine.runner.speculator.stats
    assert isinstance(forward, CompiledForward)
    first = serve(engine)  # compiles each bucket it meets
    eager, drafts, steps = forward.eager_steps, stats.num_drafts, len(engine.history)
    second = serve(engine)
    prefills = sum(r.is_prefill for r in engine.history[steps:])
    assert forward.eager_steps - eager == prefills > 0
    assert stats.num_drafts > drafts  # it speculated in the second run
    assert {(2, 64, 1), (2, 64, 3)} <= set(forward.steps)  # decode and verify rows
    plain = LLMEngine(model, max_num_seqs=2, max_model_len=64, kv_cache="paged")
    assert first == second == serve(plain)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_verify_rows_through_graph_buffers_give_the_packed_tokens(llama, kv_cache):
    """The same speculating engine with the eager forward (packed verify) and the
    graph forward (rows of k + 1 in static buffers): the same tokens, the same drafts
    accepted."""
    _, model = llama
    runs = []
    for graphs in (None, {"capture": False}):
        engine = LLMEngine(model, max_num_seqs=2, max_model_len=64, kv_cache=kv_cache,
                           cuda_graphs=graphs, speculative_config=NGRAM)
        runs.append((serve(engine), engine.runner.speculator.stats))
    (ids_a, st_a), (ids_b, st_b) = runs
    assert ids_a == ids_b and st_a == st_b and st_b.num_drafts > 0


def test_runner_parts_refuses_a_second_forward(llama, monkeypatch):
    from minillm.engine import config
    _, model = llama
    options = dict(config.ENGINE_OPTIONS)
    for name in ("cuda_graphs", "compile_decode"):  # their exclusions dropped
        o = options[name]
        options[name] = config.EngineOption(o.check, o.apply, o.order, (), (), o.part)
    monkeypatch.setattr("minillm.engine.config.ENGINE_OPTIONS", options)
    with pytest.raises(ValueError, match="has a forward already"):
        LLMEngine(model, max_num_seqs=2, max_model_len=64, cuda_graphs=True,
                  compile_decode=True)
