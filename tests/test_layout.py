"""The package's layout (issue 22): KV backends behind one interface, one scheduler and
one runner for all of them, benchmarks out of the engine's way, one CSV writer."""
from __future__ import annotations

import ast
import csv
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm.bench import results
from minillm.bench.cli import BENCHMARKS, dispatch
from minillm.engine import LLMEngine
from minillm.engine.runner import ModelRunner
from minillm.engine.paged_scheduler import PagedScheduler
from minillm.engine.scheduler import Scheduler
from minillm.kv.base import KVBackend
from minillm.kv.paged import PagedKVCache
from minillm.kv.slots import SlotKVCache
from minillm.model.loader import load_model
from minillm.model.transformer import StepMeta
from minillm.sampling import SamplingParams
from minillm.utils import bundled_model_path

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"
SHARED = {"cli", "measure", "results", "folders", "workloads"}


def imported_modules(path: Path) -> set[str]:
    """Every minillm module that `path` imports (relative imports resolved)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[:len(parts) - node.level]
                name = ".".join(base + ((node.module,) if node.module else ()))
            else:
                name = node.module or ""
            out.add(name)  # and `from minillm import quant`: the module minillm.quant.int8
            out |= {f"{name}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == "minillm" or m.startswith("minillm.")}


@pytest.fixture(scope="module")
def model():
    return load_model(bundled_model_path())


def test_no_benchmark_module_at_the_top_level():
    assert not sorted(p.name for p in PACKAGE.glob("bench*.py"))
    assert (PACKAGE / "bench" / "__main__.py").is_file()


def test_nothing_outside_bench_imports_it():
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "bench":
            continue
        bad = {m for m in imported_modules(path) if m.startswith("minillm.bench")}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_each_chapter_benchmark_imports_only_the_shared_modules():
    for name in BENCHMARKS:
        used = {m.split(".")[2] for m in imported_modules(PACKAGE / "bench" / f"{name}.py")
                if m.startswith("minillm.bench.")}
        assert used <= SHARED, f"bench/{name}.py imports {used - SHARED}"
    for name in SHARED:  # and the shared ones import no chapter's benchmark
        used = {m.split(".")[2] for m in imported_modules(PACKAGE / "bench" / f"{name}.py")
                if m.startswith("minillm.bench.")}
        assert used <= SHARED, f"bench/{name}.py imports {used - SHARED}"


def protocol_members() -> list[str]:
    return [n for n in dir(KVBackend) if not n.startswith("_")
            and n != "pad_slot"]


@pytest.mark.parametrize("backend", ["slots", "paged"])
def test_every_backend_implements_the_whole_interface(model, backend):
    kv = (SlotKVCache.from_model(model, 2, 64) if backend == "slots"
          else PagedKVCache.from_model(model, num_blocks=8, block_size=4))
    assert isinstance(kv, KVBackend)
    assert isinstance(kv.pad_slot, int)
    members = protocol_members()
    assert {"attend", "can_allocate", "allocate", "commit", "slots"} <= set(members)
    for name in members:
        ours, theirs = getattr(type(kv), name), getattr(KVBackend, name)
        if isinstance(theirs, property):
            assert isinstance(ours, property), name
            continue
        want = list(inspect.signature(theirs).parameters)
        assert list(inspect.signature(ours).parameters) == want, name


def test_a_class_missing_one_call_is_not_a_backend(model):
    class NoCommit(SlotKVCache):
        commit = None  # what isinstance sees when a backend lacks it
    kv = NoCommit.from_model(model, 2, 64)
    assert not isinstance(kv, KVBackend)


@pytest.mark.parametrize("backend", ["slots", "paged"])
def test_one_scheduler_and_one_runner_serve_every_backend(model, backend):
    """Chapter 4's runner on either backend; chapter 4's scheduler on slots, and on
    blocks the subclass the paged backend registers (preemption, shared prompts)."""
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=128, kv_cache=backend)
    assert type(engine.runner) is ModelRunner
    want = Scheduler if backend == "slots" else PagedScheduler
    assert type(engine.scheduler) is want and isinstance(engine.scheduler, Scheduler)
    assert engine.scheduler.kv is engine.kv is engine.runner.kv


def test_step_meta_has_no_unread_fields():
    assert "context_lens" not in StepMeta.__dataclass_fields__


def test_blocks_are_published_when_the_runner_commits_not_during_the_forward(model):
    """A prefix block becomes shareable only after the whole forward wrote it."""
    engine = LLMEngine(model, max_num_seqs=2, max_model_len=128, kv_cache="paged",
                       num_blocks=32, block_size=4)
    blocks = engine.kv.blocks
    commits = []
    real_commit = engine.kv.commit

    def commit(seqs=None):
        commits.append(dict(blocks.pending))  # what the forward left to publish
        real_commit(seqs)
        assert not blocks.pending
    engine.kv.commit = commit
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(list(range(1, 14)), params)  # 3 full blocks of 4
    engine.step()  # the prefill
    assert commits and sum(len(v) for v in commits[0].values()) == 3
    assert len(blocks.cached) == 3  # published by commit
    # the forward alone publishes nothing
    kv = PagedKVCache.from_model(model, num_blocks=8, block_size=4)
    assert kv.blocks.allocate("a", list(range(1, 10))) == 0
    table = kv.blocks.tables["a"]
    meta = StepMeta(positions=torch.arange(9)[None], logits_index=torch.tensor([8]),
                    slot_mapping=torch.tensor([[table[p // 4] * 4 + p % 4
                                                for p in range(9)]]),
                    block_tables=torch.tensor([table]), max_context=9)
    with torch.inference_mode():
        model(torch.arange(1, 10)[None], meta.positions, kv=kv, meta=meta)
    assert not kv.blocks.cached and kv.blocks.pending
    kv.commit()
    assert len(kv.blocks.cached) == 2 and not kv.blocks.pending


def test_the_bench_command_names_every_benchmark(capsys):
    assert dispatch(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHMARKS)
    assert dispatch([]) == 2
    assert dispatch(["bench_serving"]) == 2
    err = capsys.readouterr().err
    assert "'bench_serving' is not a benchmark" in err and "serving" in err


def test_python_dash_m_runs_each_benchmark_through_its_module():
    for name in BENCHMARKS:
        done = subprocess.run([sys.executable, "-m", "minillm.bench", name, "--help"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"python -m minillm.bench {name}" in done.stdout


def test_rows_table_takes_the_union_of_keys_and_rounds_floats():
    rows = [{"a": 1.23456789, "b": "x"}, {"a": 2.0, "c": 3}]
    assert results.rows_table(rows, {"hw": "cpu"}) == [
        ["a", "b", "c", "hw"], [1.234568, "x", "", "cpu"], [2.0, "", 3, "cpu"]]
    assert results.rows_table(rows, digits=None)[1][0] == 1.23456789


def test_file_stem_keeps_only_safe_characters():
    assert results.file_stem("serve", "My Model/v2", "cpu", "rate4") == \
        "serve_my-model-v2_cpu_rate4"
    assert results.file_stem("kv", "...", "cuda") == "kv_model_cuda"


def test_write_csvs_writes_all_or_nothing(tmp_path):
    old = tmp_path / "first.csv"
    old.write_text("old\n")

    class Bad:
        def __str__(self):
            raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        results.write_csvs(tmp_path, {"first": [["new"]], "second": [[Bad()]]})
    assert old.read_text() == "old\n"  # the first file was not replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.csv"]  # no temp files
    paths = results.write_csvs(tmp_path, {"first": [["a", "b"], [1, 2]],
                                          "second": [["c"]]})
    assert [p.name for p in paths] == ["first.csv", "second.csv"]
    with open(paths[0], newline="") as f:
        assert list(csv.reader(f)) == [["a", "b"], ["1", "2"]]
    assert oct(paths[0].stat().st_mode & 0o777) == "0o644"


def module_graph() -> dict[str, set[str]]:
    """minillm's modules and the minillm modules each one imports, imports inside
    functions included, and its package: importing minillm.serve.protocol runs
    minillm/serve/__init__.py first (issue 52: two cycles went through such files).
    The top package `minillm` is left out as a target: every module imports it."""
    mods = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
            .removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        out = set()
        parent = name.rpartition(".")[0]  # a package's own parent, for __init__
        for m in imported_modules(path) | {parent}:
            while m and m not in mods:  # `from minillm.kv import paged` -> minillm.kv
                m = m.rpartition(".")[0]
            if m and m not in (name, "minillm"):
                out.add(m)
        graph[name] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each once, as the path a -> ... -> a."""
    found, seen = [], set()

    def walk(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [nxt])
            elif nxt not in path and nxt > path[0]:  # each cycle from its smallest
                walk(nxt, path + [nxt])
    for start in sorted(graph):
        walk(start, [start])
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_minillm():
    found = cycles(module_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_sees_a_cycle_through_a_package_init():
    """minillm.serve.protocol -> (its package) minillm.serve -> a module that imports
    minillm.serve.protocol: a cycle with one edge the import statements do not show."""
    graph = module_graph()
    assert "minillm.serve" in graph["minillm.serve.protocol"]
    assert "minillm.kv" in graph["minillm.kv.paged"]
    graph["minillm.serve"] = graph["minillm.serve"] | {"minillm.structured.serve"}
    graph["minillm.structured.serve"] |= {"minillm.serve.protocol"}
    assert cycles(graph)


def test_the_tokenizer_imports_nothing_else_of_ours():
    assert module_graph()["minillm.tokenizer"] == set()


def test_kv_memory_imports_nothing_of_the_engine():
    """The engine picks its scheduler (issue 52): minillm.kv never imports engine/."""
    graph = module_graph()
    for name, out in graph.items():
        if name.startswith("minillm.kv"):
            assert not {m for m in out if m.startswith("minillm.engine")}, (name, out)


def test_chapter_4_carries_no_machinery_of_chapter_6(model):
    """Issue 37: preemption and shared prompts arrive with blocks (chapter 6), in the
    scheduler the paged backend registers; chapter 4's classes do not anticipate them."""
    for name in ("preempt", "victim", "held", "num_preemptions", "_release"):
        assert not hasattr(Scheduler(None, 4, 64), name), name
        assert hasattr(PagedScheduler(None, 4, 64), name), name
    for name in ("fork", "can_append", "append_slot", "check_weights"):
        assert not hasattr(SlotKVCache, name), name
    engine = LLMEngine(model, max_num_seqs=2, max_model_len=64, kv_cache="slots")
    assert not hasattr(engine, "held") and engine.reset_prefix_cache() is False
