"""minillm.bench.structured (chapter 11's benchmark) on the bundled model, small
settings: every part has its rows (parse rates per task, sampling and way; the mask's
cost per batch and way, in turns; compile time per backend and task); constrained
answers that end on their own parse; free decoding spends nothing on masks; the CSV
names the hardware; every argument is checked before any work. No timed asserts."""
import csv

import pytest
import torch

from minillm.bench import structured as bst
from minillm.bench.cli import BENCHMARKS

torch.set_num_threads(1)
WAYS = ["free", "xgrammar", "minillm"]


@pytest.fixture(scope="module")
def run():
    return bst.run_structured_benchmark("bundled", torch.float32, "cpu", max_tokens=16,
                                        samples=2, rounds=2, batches=(1, 2),
                                        cost_tokens=6)


def test_every_part_has_its_rows(run):
    rows, info = run.rows, run.info
    parse = [(r["task"], r["sampling"], r["way"]) for r in rows if r["part"] == "parse"]
    assert parse == [(t, s, w) for t in bst.TASKS for s in ("greedy", "T=0.8 x2")
                     for w in WAYS]
    cost = [(r["batch"], r["way"]) for r in rows if r["part"] == "cost"]
    assert cost == [(b, w) for b in (1, 2) for w in WAYS + ["minillm cold"]]
    compiled = [(r["way"], r["task"]) for r in rows if r["part"] == "compile"]
    assert compiled == [(w, t) for w in WAYS[1:] for t in bst.TASKS]
    assert info["dtype"] == "float32" and info["rounds"] == 2
    assert "structured" in BENCHMARKS


def test_constrained_answers_that_end_parse_and_free_ones_cost_no_mask(run):
    rows = run.rows
    for r in rows:
        if r["part"] == "parse" and r["way"] != "free":
            assert r["parse_rate"] == r["ended_on_their_own"]  # ended: parses
            if r["task"] == "label":
                assert r["parse_rate"] == 1.0
        if r["part"] == "cost":
            assert r["ms_per_token"] > 0
            assert (r["mask_share"] == 0) == (r["way"] == "free")
            assert 0 <= r["mask_share"] < 1
        if r["part"] == "compile":
            assert r["compile_ms"] > 0
    free = [r for r in rows if r["part"] == "cost" and r["way"] == "free"]
    assert all(r["vs_free"] == 1 for r in free)


def test_parses_and_the_table(run):
    assert bst.parses('{"street": "a", "city": "b", "postcode": "c"}',
                      bst.TASKS["address"][1])
    assert not bst.parses('{"street": "a"}', bst.TASKS["address"][1])
    assert not bst.parses("Sure! {", bst.TASKS["invoice"][1])
    assert bst.parses(" Neutral\n", None) and not bst.parses("meh", None)
    table = bst.format_table(run.rows)
    assert "mask share" in table and "compile ms" in table and "minillm cold" in table


def test_the_csv_names_the_hardware(run, tmp_path):
    rows = run.rows
    path, = run.write(tmp_path)
    assert path.name == "structured_bundled_cpu.csv"
    table = list(csv.DictReader(path.open()))
    assert len(table) == len(rows) and table[0]["hardware"] and table[0]["torch"]
    assert {t["part"] for t in table} == {"parse", "cost", "compile"}


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds=0"), (["--batch", "65"], "--batch=65"),
    (["--max-tokens", "0"], "--max-tokens=0"), (["--samples", "0"], "--samples=0"),
    (["--cost-tokens", "600"], "--cost-tokens=600"), (["--model", "nope"], "nope"),
    (["--backends", "outlines"], "invalid choice"),
    (["--backends", "minillm", "minillm"], "each at most once"),
    (["--threads", "0"], "--threads=0"), (["--dtype", "int8"], "invalid choice")])
def test_bad_arguments_stop_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bst, "run_structured_benchmark",
                        lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        bst.main(argv + ["--no-csv"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_command_runs_through_dispatch(capsys, monkeypatch, tmp_path):
    """`python -m minillm.bench structured ...`: the table printed, the CSV named."""
    from minillm.bench.cli import dispatch
    monkeypatch.setattr(bst, "run_structured_benchmark", lambda *a, **k: bst.Result(
        [{"part": "compile", "task": "label", "way": "minillm", "compile_ms": 1.0}],
        {"model": "bundled", "device": "cpu"}, kind="structured", key="way"))
    assert dispatch(["structured", "--model", "bundled", "--dtype", "float32",
                     "--threads", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "compile ms" in out and (tmp_path / "structured_bundled_cpu.csv").is_file()
