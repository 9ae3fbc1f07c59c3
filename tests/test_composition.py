"""Issue 52: what runs when you call LLM(...) is written in one place.

One validated EngineConfig; later chapters' options applied in an order written as data
(not by import order); registries filled by minillm/features.py on first use; no method
attached to another module's class and no instance patched; the bugs found by reading."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minillm.engine import LLMEngine
from minillm.engine.config import ENGINE_OPTIONS, EngineConfig, check_int
from minillm.engine.graphs import GraphForward
from minillm.model.loader import load_model
from minillm.sampling import SamplingParams
from minillm.speculative.runner import Speculator
from minillm.utils import bundled_model_path

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def model():
    return load_model(bundled_model_path())


def python(code: str) -> str:
    """Run `code` in a fresh interpreter; its standard output."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


# --- one config, each argument checked once -------------------------------------------

def test_check_int_refuses_what_is_not_an_int_in_range():
    assert check_int("n", 3) == 3 and check_int("n", 0, low=0) == 0
    for bad in (True, 2.0, "3", None, 0, -1):
        with pytest.raises(ValueError, match=r"n=.*must be an int >= 1"):
            check_int("n", bad)
    with pytest.raises(ValueError, match=r"n=9: must be an int in 1\.\.8"):
        check_int("n", 9, 1, 8)


def test_the_config_fills_defaults_and_sorts_the_arguments(model):
    cfg = EngineConfig.create(model, max_num_seqs=4, block_size=8, cuda_graphs=True)
    assert cfg.max_model_len == model.config.context_length
    assert cfg.max_num_batched_tokens == max(2048, cfg.max_model_len)
    assert cfg.kv_cache == "paged" and cfg.kv_options == {"block_size": 8}
    assert cfg.options["cuda_graphs"] is True and cfg.options["speculative_config"] is None
    assert [name for name, _, _ in cfg.ordered_options()] == [
        "cuda_graphs", "structured_outputs_config"]


def test_a_misspelt_option_lists_every_option_there_is(model):
    """Before: `cuda_graph=True` listed only the KV backend's options."""
    with pytest.raises(ValueError) as e:
        LLMEngine(model, cuda_graph=True)
    for name in ("cuda_graph", "cuda_graphs", "speculative_config", "block_size",
                 "max_num_seqs", "compile_decode"):
        assert name in str(e.value), name


def test_conflicting_options_are_refused_before_any_memory_is_taken(model, monkeypatch):
    """Before: cuda_graphs=True with compile_decode=True was refused only after the KV
    pool was allocated and the graphs captured."""
    import minillm.engine.llm_engine as llm_engine

    def no_kv(*args, **kwargs):
        raise AssertionError("the KV pool was built before the arguments were checked")
    monkeypatch.setattr(llm_engine, "make_kv", no_kv)
    with pytest.raises(ValueError, match="cuda_graphs and compile_decode"):
        LLMEngine(model, cuda_graphs=True, compile_decode=True)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLMEngine(model, max_num_seqs=0)
    with pytest.raises(ValueError, match="block_size=3"):  # the backend's own
        LLMEngine(model, block_size=3)
    with pytest.raises(ValueError, match="enable_prefix_caching='yes'"):
        LLMEngine(model, enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="policy='static'"):  # paged is continuous
        LLMEngine(model, kv_cache="paged", policy="static")
    with pytest.raises(ValueError, match="speculative_config needs policy='continuous'"):
        LLMEngine(model, kv_cache="slots", policy="static", speculative_config=NGRAM)


def test_a_huge_max_num_seqs_is_refused_at_once(model):
    """Before: LLMEngine(max_num_seqs=10**9) took 16 s and 2 GB before answering."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"max_num_seqs=1000000000: must be an int in"):
        LLMEngine(model, max_num_seqs=10**9)
    assert time.perf_counter() - start < 1.0


CHECK_SITES = {  # argument -> the modules that raise about its value (one function each)
    "max_num_seqs": ["engine/config.py"],
    "max_num_batched_tokens": ["engine/config.py"],
    "max_model_len": ["engine/config.py",
                      "parallel/plan.py"],  # plan_parallel's own (vLLM's name)
    "policy": ["engine/scheduler.py",  # check_policy
               "kv/paged.py"],         # the paged backend schedules continuously
    "enable_chunked_prefill": ["engine/scheduler.py"],
    "block_size": ["kv/blocks.py"],    # check_block_size
}


def test_each_engine_argument_is_checked_in_one_place():
    """The modules that check LLMEngine's arguments, listed: a new check site fails
    this test until it is listed here (or, better, removed)."""
    sites = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "bench" in path.parts:
            continue
        text = path.read_text()
        for name in CHECK_SITES:
            if f'ValueError(f"{name}=' in text or f'check_int("{name}"' in text:
                sites.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    assert sites == CHECK_SITES


# --- what runs is written as data -------------------------------------------------------

def test_options_apply_in_their_order_not_the_registration_order(model, monkeypatch):
    """Each option builds its own part of the runner: whatever order the table holds
    them in, the engine has the graph forward and the speculator."""
    for order in (list(ENGINE_OPTIONS.items()), list(ENGINE_OPTIONS.items())[::-1]):
        monkeypatch.setattr("minillm.engine.config.ENGINE_OPTIONS", dict(order))
        engine = LLMEngine(model, max_num_seqs=2, max_model_len=128, cuda_graphs=True,
                           speculative_config=NGRAM)
        assert isinstance(engine.runner.speculator, Speculator)
        assert isinstance(engine.runner.forward, GraphForward)


def test_reordering_imports_changes_nothing():
    """Whatever chapter's module comes first, the same parts run in the same order."""
    probe = ("from minillm.engine import LLMEngine\n"
             "from minillm.model.loader import load_model\n"
             "from minillm.utils import bundled_model_path\n"
             "e = LLMEngine(load_model(bundled_model_path()), max_num_seqs=2, "
             "max_model_len=128, cuda_graphs=True, speculative_config="
             f"{NGRAM!r})\n"
             "import json\n"
             "print(json.dumps([[n for n, _, _ in e.config.ordered_options()], "
             "type(e.kv).__name__, type(e.scheduler).__name__, "
             "type(e.runner.speculator).__name__, type(e.runner.forward).__name__, "
             "[type(p).__name__ for p in e.runner.logits_processors]]))")
    orders = ["import minillm.structured.engine, minillm.speculative.engine, "
              "minillm.engine.graphs, minillm.kv.paged\n",
              "import minillm.kv.paged, minillm.engine.graphs, minillm.speculative.engine, "
              "minillm.structured.engine\n",
              ""]
    seen = [json.loads(python(first + probe)) for first in orders]
    assert seen[0] == seen[1] == seen[2], seen
    assert seen[0][1:5] == ["PagedKVCache", "PagedScheduler", "Speculator",
                            "GraphForward"]


def test_the_tokenizer_loads_no_engine():
    """Chapter 1's tokenizer imports nothing else of ours, and importing it does not
    load the engine or torch.compile's machinery."""
    out = python("import sys, minillm.tokenizer\n"
                 "print(sorted(m for m in sys.modules if m.startswith('minillm')))\n"
                 "print('torch._dynamo' in sys.modules)")
    mods, dynamo = out.splitlines()
    assert eval(mods) == ["minillm", "minillm.tokenizer"] and dynamo == "False"


def test_the_server_and_the_command_line_name_no_later_chapter():
    for path in (PACKAGE / "serve" / "__init__.py", PACKAGE / "__main__.py",
                 PACKAGE / "__init__.py"):
        tree = ast.parse(path.read_text())
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        named = [ast.unparse(n) for n in imports if "spec" in ast.unparse(n)
                 or "structured" in ast.unparse(n)]
        assert not named, (path.name, named)
    text = (PACKAGE / "features.py").read_text()
    for module in ("minillm.speculative.engine", "minillm.structured.engine",
                   "minillm.speculative.serve", "minillm.structured.serve", "minillm.quant.int8"):
        assert f'"{module}"' in text, module


# --- no patching ------------------------------------------------------------------------

def attachments(path: Path) -> list[tuple[str, str]]:
    """(class, attribute) for each top-level `Class.attr = ...` in a module."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets
                       for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
            out += [(t.value.id, t.attr) for t in targets if isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)]
    return out


def test_no_module_attaches_to_a_class_it_does_not_define():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        bad += [f"{path.relative_to(PACKAGE)}: {cls}.{attr}"
                for cls, attr in attachments(path) if cls[:1].isupper() and cls not in own]
    assert not bad, bad


def attached_values(path: Path) -> list[str]:
    """The names a module attaches to a class (`Class.x = _x` -> `_x`)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) or (isinstance(t, ast.Tuple) and all(
                    isinstance(e, ast.Attribute) for e in t.elts)) for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            out += [v.id for v in values if isinstance(v, ast.Name)]
    return out


def test_every_attached_function_is_defined_in_the_module_that_attaches_it():
    """Go to definition lands in the module that names the method: no module attaches
    a function it imported (llm_engine.py once attached step_outputs.py's)."""
    bad = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(
            n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        bad += [f"{path.relative_to(PACKAGE)}: {name}" for name in attached_values(path)
                if name.startswith("_") and name not in defined]
    assert not bad, bad


def test_the_attached_finder_sees_an_imported_function(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from x import _f\nclass E: pass\ndef _g(): pass\nE.f, E.g = _f, _g\n")
    assert attached_values(path) == ["_f", "_g"]


def test_attention_lives_in_one_module():
    """The functions that attend over a cache live in minillm/kv/attention.py (chapters 3
    and 4 each export theirs into it); no KV backend computes attention itself."""
    from minillm.kv import attention
    assert {"causal_mask", "cached_attention", "packed_groups",
            "packed_attention"} <= set(attention.__all__)
    for path in (PACKAGE / "kv").glob("*.py"):
        if path.name == "attention.py":
            continue
        text = path.read_text()
        assert "scaled_dot_product_attention" not in text, path.name
        assert "def cached_attention" not in text and "def packed_attention" not in text


def test_the_finder_finds_an_attachment(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from x import Engine\nEngine.step, Engine.run = f, g\n")
    assert attachments(path) == [("Engine", "step"), ("Engine", "run")]


def test_no_instance_is_patched_and_no_private_block_state_is_touched():
    private = ("._take(", "._evict(", ".ref_count", ".free_blocks", ".pending",
               ".unpublished", ".request_keys", ".key_of", ".hash_of")
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "MethodType" not in text, path
        if path.name != "blocks.py":
            used = [p for p in private if p in text.replace("self._take(", "")]
            assert not used, (path.relative_to(PACKAGE), used)


# --- bugs found by reading --------------------------------------------------------------

def test_an_automatic_request_id_never_collides_with_an_answer_id(model):
    """Before: add_request(..., request_id="1_0"), then an n=2 request, whose automatic
    id "0" gives its second answer the id "1_0": a ValueError."""
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=64)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="1_0")
    rid = engine.add_request([5, 6, 7], SamplingParams(n=2, max_tokens=2, seed=1))
    assert rid != "0" and f"1_{rid}" in engine.requests
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop(rid)) == 2 and engine.pop("1_0").output_ids
    engine.add_request([5, 6], request_id="1_0")  # free again once collected
    with pytest.raises(ValueError, match="request_id='1_0'"):  # and still unique
        engine.add_request([5, 6], request_id="1_0")


def test_a_0d_tensor_of_stop_token_ids_is_a_clear_error():
    """Before: SamplingParams(stop_token_ids=torch.tensor(3)) raised TypeError
    'iteration over a 0-d tensor'."""
    import torch
    with pytest.raises(ValueError, match=r"stop_token_ids=tensor\(3\) is not allowed"):
        SamplingParams(stop_token_ids=torch.tensor(3))
    assert SamplingParams(stop_token_ids=[3]).stop_token_ids == (3,)


# --- the lean step: work per decode step that does not grow ----------------------------

class CountingList(list):
    """A list that counts the copies made of it (slices of more than one block)."""
    copies = 0

    def __add__(self, other):
        CountingList.copies += 1
        return list(self) + list(other)

    def __getitem__(self, i):
        if isinstance(i, slice) and len(range(*i.indices(len(self)))) > 16:
            CountingList.copies += 1
        return super().__getitem__(i)


def test_a_decode_step_copies_no_token_list_and_walks_no_weight(model, monkeypatch):
    """Before: every step copied each running request's prompt + output (the paged
    backend's append_slot; the penalties' ids, uploaded whole every step), and while
    a request waited every parameter was walked (the prefix cache's weights check)."""
    import minillm.kv.paged as paged
    walks = []
    real = paged.weights_version
    monkeypatch.setattr(paged, "weights_version", lambda m: walks.append(1) or real(m))
    engine = LLMEngine(model, max_num_seqs=3, max_model_len=256, block_size=4,
                       num_blocks=64)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    penalized = SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.2, seed=3)
    for i in range(3):  # 25 blocks each: the third waits for memory, asked each step
        engine.add_request([1 + (i * 5 + j) % 300 for j in range(100)],
                           penalized if i == 1 else params)
    for _ in range(3):  # prompts computed, the cache's weights noted once
        engine.step()
    for seq in engine.scheduler.running:
        seq.prompt_ids = CountingList(seq.prompt_ids)
        seq.output_ids = CountingList(seq.output_ids)
    CountingList.copies, walks[:] = 0, []
    for _ in range(12):
        engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 1
    assert CountingList.copies == 0 and walks == []


def test_the_counting_list_counts_a_copy():
    tokens = CountingList(range(100))
    CountingList.copies = 0
    _ = tokens + [1]
    _ = tokens[:50]
    _ = tokens[:3]  # one block or less: not a copy of the list
    assert CountingList.copies == 2


def test_the_prefix_cache_still_forgets_what_old_weights_computed(model):
    """The weights check runs only when a hit is about to be used: a hit after the
    weights changed is refused, and the cache is forgotten."""
    import copy
    import torch
    m = copy.deepcopy(model)
    engine = LLMEngine(m, max_num_seqs=2, max_model_len=128, block_size=4)
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request(prompt, params, request_id="a")
    while engine.has_unfinished():
        engine.step()
    hits = engine.kv.blocks.hits
    with torch.no_grad():
        m.layers[0].mlp.down_proj.weight.mul_(0.5)  # changed in place
    engine.add_request(prompt, params, request_id="b")
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.blocks.hits == hits  # nothing reused
    engine.add_request(prompt, params, request_id="c")  # same weights now: a hit
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.blocks.hits > hits


def test_answers_held_for_their_prompt_count_as_waiting(model):
    """Before: the server's max_waiting and its waiting metric read len(waiting), which
    misses answers 1..n-1 that chapter 6's scheduler holds until answer 0 computed the
    prompt."""
    engine = LLMEngine(model, max_num_seqs=1, max_model_len=128)
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request([5, 6, 7], long)
    engine.step()  # it runs: the one row is taken
    engine.add_request([8, 9, 10], SamplingParams(n=3, max_tokens=5, seed=0))
    assert len(engine.scheduler.waiting) == 1 and engine.scheduler.num_waiting() == 3
    slots = LLMEngine(model, max_num_seqs=1, max_model_len=128, kv_cache="slots")
    slots.add_request([8, 9, 10], SamplingParams(n=3, max_tokens=5, seed=0))
    assert slots.scheduler.num_waiting() == 3  # chapter 4 holds none back


def test_one_sampling_params_class_takes_every_chapters_fields():
    """Chapter 11's structured_outputs is a field registered in chapter 2's
    SAMPLING_FIELDS, not a subclass swapped in at the front door."""
    import dataclasses

    import minillm
    from minillm import sampling
    from minillm.structured import params as structured
    assert minillm.SamplingParams is sampling.SamplingParams
    assert not any(isinstance(v, type) and issubclass(v, sampling.SamplingParams)
                   for v in vars(structured).values())
    p = sampling.SamplingParams(structured_outputs={"regex": "a+"}, max_tokens=4)
    assert p.structured_outputs == structured.StructuredOutputsParams(regex="a+")
    assert dataclasses.replace(p, temperature=0.5).structured_outputs == \
        p.structured_outputs
    assert sampling.SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match=r"extra_args=\{'foo': 1\} is not allowed"):
        sampling.SamplingParams(extra_args={"foo": 1})  # nothing silently ignored
    with pytest.raises(ValueError, match="ignore_eos=True"):  # checked with the rest
        sampling.SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True)
    out = python("from minillm.sampling import SamplingParams\n"
                 "print(SamplingParams(structured_outputs={'choice': ['x']})"
                 ".structured_outputs.kind)")
    assert out.strip() == "choice"


def test_seen_ids_hold_the_requests_ids_as_they_grow_and_shrink():
    """The penalties' ids kept on the device equal prompt + output after every step,
    also across the buffer's growth and when ids are taken back."""
    import torch
    from minillm.engine.runner import SeenIds
    from minillm.sequence import Sequence
    seq = Sequence("r", list(range(5)), SamplingParams(max_tokens=500), frozenset())
    seen = SeenIds(torch.device("cpu"))
    for step in range(40):
        history, outputs = seen.of(seq)
        assert history.tolist() == seq.prompt_ids + seq.output_ids
        assert outputs.tolist() == seq.output_ids
        seq.output_ids.extend([step % 7] * (step % 3))
    del seq.output_ids[-4:]  # taken back
    assert seen.of(seq)[0].tolist() == seq.prompt_ids + seq.output_ids


def test_a_drafted_view_reads_the_requests_ids_without_copying_them():
    """Before: Drafted.output_ids built output + drafts as a new list on every access
    (chapter 4's prepare_packed and min_tokens read it per view, per step)."""
    from minillm.sequence import Sequence, block_early_stop
    from minillm.speculative.proposers import Drafted
    import torch
    seq = Sequence("r", CountingList(range(30)), SamplingParams(min_tokens=50, max_tokens=60),
                   frozenset({2}))
    seq.output_ids = CountingList(range(100, 140))
    view = Drafted(seq, [7, 8, 9])
    CountingList.copies = 0
    assert len(view.output_ids) == 43 and view.num_tokens == 73
    assert view.output_ids[38:43] == [138, 139, 7, 8, 9]
    assert view.output_ids[:] == list(range(100, 140)) + [7, 8, 9]
    CountingList.copies = 0
    logits = block_early_stop(torch.zeros(1, 4), [view])
    assert logits[0, 2] == float("-inf") and CountingList.copies == 0
