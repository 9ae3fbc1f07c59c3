"""minillm.bench.serving (chapter 4's serving benchmark): a seeded workload, five ways to
serve it, metrics that add up, CSV files that explain themselves, and every argument
checked before any work. Small models and short outputs; no timed asserts."""
import csv
import os

import pytest
import torch

from helpers import forbid
from minillm.bench import cli, workloads
from minillm.bench import serving as bs
from minillm.model.config import ModelConfig
from minillm.utils import bundled_model_path, repo_root

SMALL = dict(num_requests=6, max_num_seqs=3, prompt_tokens=(4, 12), output_tokens=(2, 9),
             device="cpu", prompts="random", progress=False)
SMALL_CLI = ["--requests", "3", "--max-num-seqs", "2", "--prompt-tokens", "4", "8",
             "--output-tokens", "2", "4", "--prompts", "random"]


@pytest.fixture(scope="module")
def result(folder):
    return bs.run_serving_benchmark(folder, **SMALL)


def workload(folder, **kwargs):
    config = ModelConfig.from_hf(folder)
    args = dict(num_requests=6, prompt_tokens=(4, 12), output_tokens=(2, 9), seed=0)
    return bs.make_workload(config, **{**args, **kwargs})


def test_workload_is_seeded_and_in_range(folder):
    first, again = workload(folder), workload(folder)
    assert [(r.prompt_ids, r.output_len) for r in first] == [
        (r.prompt_ids, r.output_len) for r in again]
    other = workload(folder, seed=1)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in first]
    assert [r.index for r in first] == list(range(6))
    assert all(4 <= len(r.prompt_ids) <= 12 and 2 <= r.output_len <= 9 for r in first)
    assert all(0 <= t < 101 for r in first for t in r.prompt_ids)
    assert all(r.arrival_s == 0.0 for r in first)  # offline


def test_poisson_arrivals_grow_at_about_the_rate(folder):
    requests = workload(folder, num_requests=400, rate=20.0)
    times = [r.arrival_s for r in requests]
    assert times[0] > 0 and all(a < b for a, b in zip(times, times[1:]))
    assert 0.8 / 20 < times[-1] / 400 < 1.2 / 20  # mean gap: 1 / rate
    assert times == [r.arrival_s for r in workload(folder, num_requests=400, rate=20.0)]
    offline = workload(folder, num_requests=400)  # the same requests, arriving at 0
    assert [(r.prompt_ids, r.output_len) for r in offline] == [
        (r.prompt_ids, r.output_len) for r in requests]


@pytest.mark.skipif(bs.shakespeare_missing(bundled_model_path()) is not None,
                    reason="needs data/plays and the bundled tokenizer")
def test_prompts_are_cut_from_the_held_out_plays():
    from minillm.tokenizer import Tokenizer
    path = bundled_model_path()
    config = ModelConfig.from_hf(path)
    requests = bs.make_workload(config, 4, (16, 128), (16, 256), seed=3, model_path=path)
    stream = workloads.heldout_ids(str(path))
    tok = Tokenizer.from_pretrained(path)
    for r in requests:
        assert r.prompt_ids[0] == config.bos_token_id
        body = r.prompt_ids[1:]
        starts = [i for i in range(len(stream)) if list(stream[i:i + len(body)]) == body]
        assert starts, "a prompt is a slice of the held-out text"
        assert any(c.isalpha() for c in tok.decode(body))


def test_rows_metrics_and_requests_add_up(result, folder):
    names = [r["method"] for r in result.rows]
    assert names == [bs.METHODS[k] for k in bs.DEFAULT_METHODS]
    drawn = workload(folder)
    total = sum(r.output_len for r in drawn)
    for row in result.rows:
        assert row["requests"] == 6 and row["useful_tokens"] == total
        assert row["wall_s"] > 0 and row["output_tok_s"] > 0 and row["requests_s"] > 0
        for m in ("ttft", "e2e"):
            assert 0 < row[f"{m}_p50_s"] <= row[f"{m}_p99_s"]
        assert 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"]
        assert row["output_tok_s"] == pytest.approx(total / row["wall_s"])
    assert result.rows[0]["speedup_vs_first"] == 1.0
    assert result.ratio("minillm-one-by-one", "minillm continuous") == pytest.approx(
        result.row("minillm continuous")["output_tok_s"]
        / result.row("minillm one by one")["output_tok_s"])
    assert result.info["drawn_output_tokens"] == total
    assert result.info["prompts"] == "random" and result.info["model"] == "tiny model"


def test_padding_is_counted_only_for_static_batches(result, folder):
    drawn = workload(folder)
    batches = [drawn[:3], drawn[3:]]  # offline, FIFO, max_num_seqs=3
    padding = sum(len(b) * max(r.output_len for r in b) - sum(r.output_len for r in b)
                  for b in batches)
    assert padding > 0
    for name in ("transformers static batched", "minillm static"):
        assert result.row(name)["padding_rows"] == padding
        assert 0 < result.row(name)["padding_share"] < 1
    for name in ("transformers one by one", "minillm one by one", "minillm continuous"):
        assert result.row(name)["padding_rows"] == 0
        assert result.row(name)["padding_share"] == 0.0


def test_minillm_methods_make_the_same_tokens(result):
    assert result.info["same_tokens_reference"] == "minillm one by one"
    for name in ("minillm one by one", "minillm static", "minillm continuous"):
        assert result.row(name)["same_tokens"] is True
        assert all(r["same_tokens"] for r in result.rows_of("requests", name))


def test_per_request_records_for_a_gantt_chart(result, folder):
    drawn = {r.index: r for r in workload(folder)}
    assert len(result.tables["requests"]) == 5 * 6
    for method in bs.DEFAULT_METHODS:
        records = result.rows_of("requests", method)
        assert [r["request"] for r in records] == list(range(6))
        for r in records:
            assert r["output_tokens"] == drawn[r["request"]].output_len
            assert r["prompt_tokens"] == len(drawn[r["request"]].prompt_ids)
            assert r["arrival_s"] <= r["first_token_s"] <= r["finish_s"]
            assert r["e2e_s"] == pytest.approx(r["finish_s"] - r["arrival_s"])


def test_online_requests_start_only_after_they_arrive(folder):
    run = bs.run_serving_benchmark(
        folder, **{**SMALL, "rate": 40.0,
                   "methods": ("minillm-one-by-one", "minillm-continuous")})
    assert run.info["arrivals"] == "Poisson 40 req/s"
    arrivals = [r["arrival_s"] for r in run.rows_of("requests", "minillm continuous")]
    assert arrivals[0] > 0 and arrivals == sorted(arrivals)
    for r in run.tables["requests"]:
        assert 0 < r["arrival_s"] < r["first_token_s"] <= r["finish_s"]
    assert all(row["wall_s"] >= arrivals[-1] for row in run.rows)
    assert run.row("minillm continuous")["same_tokens"] is True


def test_table_and_csv_files(result, tmp_path):
    table = bs.format_serving_table(result)
    assert "minillm continuous" in table and "TTFT p50/p99" in table
    summary, per_request = bs.write_serving_csv(result, tmp_path / "csv")
    assert summary.name == "serve_tiny-model_cpu_offline.csv"
    assert per_request.name == "serve_tiny-model_cpu_offline_requests.csv"
    rows = list(csv.DictReader(summary.open()))
    assert [r["method"] for r in rows] == [bs.METHODS[k] for k in bs.DEFAULT_METHODS]
    for column in ("output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s",
                   "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_s", "e2e_p99_s", "wall_s",
                   "padding_share", "same_tokens", "hardware", "torch", "transformers",
                   "max_num_seqs", "arrivals", "seed"):
        assert column in rows[0], column
    assert all(r["hardware"] and r["torch"] == torch.__version__ for r in rows)
    records = list(csv.DictReader(per_request.open()))
    assert len(records) == 5 * 6
    assert {"method", "request", "arrival_s", "first_token_s", "finish_s"} <= set(records[0])
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == sorted(
        [summary.name, per_request.name])  # no temporary files left behind
    assert all(path.stat().st_mode & 0o044 == 0o044  # readable by everybody
               for path in (summary, per_request))


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a model is loaded: bad arguments must stop everything before."""
    forbid(monkeypatch, bs, "load_model", "a model was loaded despite a bad argument")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_requests=0), "num_requests=0"),
    (dict(num_requests=2.0), "num_requests=2.0"),
    (dict(max_num_seqs=True), "max_num_seqs=True"),
    (dict(seed=-1), "seed=-1"),
    (dict(rate=0), "rate=0"),
    (dict(rate=float("inf")), "rate=inf"),
    (dict(rate="fast"), "rate='fast'"),
    (dict(methods=("fast",)), "methods=.*minillm-continuous"),
    (dict(methods=()), "methods=()"),
    (dict(methods=("minillm-static", "minillm static")), "different names"),
    (dict(prompts="poems"), "prompts='poems'; allowed"),
    (dict(prompts="shakespeare"), "tokenizer.json.*prompts='random'"),
    (dict(prompt_tokens=(0, 4)), "prompt_tokens=.0, 4."),
    (dict(prompt_tokens=(9, 4)), "low <= high"),
    (dict(output_tokens=5), "output_tokens=5"),
    (dict(prompt_tokens=(4, 100), output_tokens=(2, 40)), "context of 128"),
    (dict(max_num_batched_tokens=2), "max_num_batched_tokens=2 is smaller than "
     "max_num_seqs=3"),
    (dict(long_prompts=(0, 20)), "long_prompts=.0, 20."),
    (dict(long_prompts=(0.5, 2.5)), "tokens an int"),
    (dict(long_prompts=0.5), "long_prompts=0.5"),
    (dict(long_prompts=(0.5, 120), output_tokens=(2, 9)), "long_prompts.*context"),
    (dict(rounds=0), "rounds=0"),
    (dict(rounds=1.5), "rounds=1.5"),
])
def test_bad_arguments_raise_before_any_work(folder, no_load, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bs.run_serving_benchmark(folder, **{**SMALL, **kwargs})


def test_a_missing_model_folder(tmp_path, no_load):
    with pytest.raises(FileNotFoundError, match="config.json"):
        bs.run_serving_benchmark(tmp_path / "missing", **SMALL)


def test_auto_prompts_say_when_they_are_random(folder):
    with pytest.warns(UserWarning, match="random prompt ids.*tokenizer.json"):
        run = bs.run_serving_benchmark(folder, **{**SMALL, "prompts": "auto",
                                                  "num_requests": 1,
                                                  "methods": ("minillm-continuous",)})
    assert run.info["prompts"] == "random"


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as stop:
        bs.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "python -m minillm.bench serving" in out
    assert all(flag in out for flag in ("--rate", "--max-num-seqs", "--methods"))


@pytest.fixture
def no_run(monkeypatch):
    forbid(monkeypatch, bs, "run_serving_benchmark",
           "the benchmark started despite a bad argument")


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads=0: allowed 1 to"),
    (["--requests", "0"], "num_requests=0"),
    (["--requests", "many"], "invalid int value: 'many'"),
    (["--max-num-seqs", "0"], "max_num_seqs=0"),
    (["--rate", "-2"], "rate=-2.0"),
    (["--methods", "vllm"], "invalid choice: 'vllm'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--prompt-tokens", "100", "120", "--output-tokens", "2", "20"], "context of 128"),
    ([*SMALL_CLI, "--prompts", "shakespeare"], "tokenizer.json"),
    (["--model", "no-such-model"], "model='no-such-model'; allowed"),
    ([*SMALL_CLI, "--rounds", "0"], "rounds=0"),
    ([*SMALL_CLI, "--long-prompts", "0.1", "20.5"], "long_prompts=(0.1, 20.5)"),
    ([*SMALL_CLI, "--long-prompts", "2", "20"], "long_prompts=(2.0, 20)"),
    ([*SMALL_CLI, "--max-num-batched-tokens", "1"], "max_num_batched_tokens=1 is"),
])
def test_bad_cli_arguments_exit_with_status_2(folder, tmp_path, no_run, capsys, args,
                                              message):
    with pytest.raises(SystemExit) as stop:
        bs.main(["--model", str(folder), "--out", str(tmp_path / "out"), *args])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_the_command_writes_its_csv_files(folder, tmp_path, monkeypatch, capsys):
    reference = repo_root() / "data" / "benchmarks"
    before = {p.name: p.read_bytes() for p in reference.glob("*.csv")}
    threads = torch.get_num_threads()
    monkeypatch.chdir(tmp_path)
    assert bs.main(["--model", str(folder), "--threads", "1", *SMALL_CLI,
                    "--methods", "minillm-one-by-one", "minillm-continuous"]) == 0
    written = tmp_path / cli.DEFAULT_OUT / "serve_tiny-model_cpu_offline.csv"
    out = capsys.readouterr().out
    assert written.is_file() and "minillm continuous" in out and "wrote" in out
    assert "torch threads: 1" in written.read_text()  # --threads applied to the run
    assert torch.get_num_threads() == threads  # ... and restored afterwards
    assert {p.name: p.read_bytes() for p in reference.glob("*.csv")} == before


def test_the_command_passes_long_prompts_and_the_budget(folder, tmp_path,
                                                         monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bs.main(["--model", str(folder), *SMALL_CLI, "--long-prompts", "0.5", "30",
                    "--max-num-batched-tokens", "8", "--no-csv",
                    "--methods", "minillm-continuous", "minillm-unchunked"]) == 0
    out = capsys.readouterr().out
    assert "minillm unchunked" in out and "ITL p50/p99 ms" in out


def test_no_csv_writes_nothing(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bs.main(["--model", str(folder), "--no-csv", *SMALL_CLI,
                    "--methods", "minillm-continuous"]) == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["offline", "rate4"])
def test_recorded_reference_data_is_complete(mode):
    """The chapter reads these files: every method, its hardware, tokens that add up."""
    reference = repo_root() / "data" / "benchmarks"
    rows = list(csv.DictReader((reference / f"serve_bundled_cpu_{mode}.csv").open()))
    assert [r["method"] for r in rows] == [bs.METHODS[k] for k in bs.DEFAULT_METHODS]
    drawn = int(rows[0]["drawn_output_tokens"])
    for r in rows:
        assert r["hardware"] and r["torch"] and r["num_requests"] == "64"
        assert int(r["useful_tokens"]) == drawn and float(r["output_tok_s"]) > 0
        assert r["same_tokens"] == "True" or not r["method"].startswith("minillm")
    records = list(csv.DictReader(
        (reference / f"serve_bundled_cpu_{mode}_requests.csv").open()))
    assert len(records) == 5 * 64
    assert all(float(x["arrival_s"]) <= float(x["first_token_s"]) <= float(x["finish_s"])
               for x in records)


def test_recorded_runs_serve_the_same_requests():
    """Offline and online differ only in the arrival times."""
    reference = repo_root() / "data" / "benchmarks"
    lengths = {}
    for mode in ("offline", "rate4"):
        path = reference / f"serve_bundled_cpu_{mode}_requests.csv"
        lengths[mode] = [(x["request"], x["prompt_tokens"], x["output_tokens"])
                         for x in csv.DictReader(path.open())]
    assert lengths["offline"] == lengths["rate4"]


def test_rounds_run_the_methods_in_turns_and_keep_the_median_run(folder, monkeypatch):
    """rounds=3: each round runs every method once (A B A B A B, after the warm-up), and
    a method's row is its run of median wall time, with the spread beside it."""
    order, walls = [], iter([5.0, 1.0, 3.0, 2.0, 4.0, 9.0])  # A, B, A, B, A, B
    real = bs.run_engine

    def timed(model, reqs, policy, *args, **kwargs):
        run = real(model, reqs, policy, *args, **kwargs)
        if len(reqs) == 6:  # not the warm-up
            order.append(policy)
            run.wall_s = next(walls)
        return run
    monkeypatch.setattr(bs, "run_engine", timed)
    result = bs.run_serving_benchmark(
        folder, **{**SMALL, "methods": ("minillm-static", "minillm-continuous"),
                   "rounds": 3})
    assert order == ["static", "continuous"] * 3
    total = result.row("minillm static")["useful_tokens"]
    static, cont = result.row("minillm static"), result.row("minillm continuous")
    assert static["wall_s"] == 4.0 and cont["wall_s"] == 2.0  # the medians
    assert static["output_tok_s_min"] == total / 5.0
    assert static["output_tok_s_max"] == total / 3.0
    assert cont["output_tok_s_min"] == total / 9.0 and cont["rounds"] == 3
    assert static["same_tokens"] and cont["same_tokens"]  # in every round
    assert "the median of 3 rounds in turns" in result.describe()


def test_long_prompts_replace_a_share_of_the_prompts(folder):
    """long_prompts=(share, tokens): about `share` of the prompts are `tokens` long,
    the rest as drawn; without it the workload is the one it always was."""
    plain = workload(folder, num_requests=400)
    mixed = workload(folder, num_requests=400, long_prompts=(0.25, 40))
    long = [r for r in mixed if len(r.prompt_ids) == 40]
    assert 70 <= len(long) <= 130
    assert all(4 <= len(r.prompt_ids) <= 12 for r in mixed if r not in long)
    assert [len(r.prompt_ids) for r in plain] == [
        len(r.prompt_ids) for r in workload(folder, num_requests=400)]


def test_inter_token_latency_is_every_gap_between_two_tokens():
    """itl_p50/p99: over all gaps of all requests; itl_max per request."""
    runs = bs.MethodRun("m", [bs.Served(0, [1, 2, 3], [1.0, 1.1, 1.4]),
                              bs.Served(1, [4, 5], [2.0, 2.2])], 3.0, 5, 0)
    reqs = [bs.Request(0, [1], 3, 0.0), bs.Request(1, [1], 2, 0.5)]
    row, records = bs.summarise_run(runs, reqs, None)
    gaps = sorted([100.0, 300.0, 200.0])
    assert row["itl_p50_ms"] == pytest.approx(bs.percentile(gaps, 50))
    assert row["itl_p99_ms"] == pytest.approx(bs.percentile(gaps, 99))
    assert [r["itl_max_ms"] for r in records] == pytest.approx([300.0, 200.0])
    assert records[1]["ttft_s"] == pytest.approx(1.5)


def test_unchunked_computes_prompts_whole_and_makes_the_same_tokens(folder):
    """A budget below the longest prompt: 'minillm continuous' chunks it,
    'minillm unchunked' gets a budget the size of that prompt; same tokens."""
    seen = []
    real = bs.LLMEngine

    def spy(*args, **kwargs):
        engine = real(*args, **kwargs)
        seen.append((kwargs["enable_chunked_prefill"],
                     engine.scheduler.max_num_batched_tokens))
        return engine

    mp = pytest.MonkeyPatch()
    mp.setattr(bs, "LLMEngine", spy)
    try:
        res = bs.run_serving_benchmark(
            folder, **{**SMALL, "prompt_tokens": (4, 12)}, max_num_batched_tokens=4,
            long_prompts=(0.5, 30), methods=("minillm-continuous", "minillm-unchunked"))
    finally:
        mp.undo()
    longest = max(r["prompt_tokens"] for r in res.tables["requests"])
    assert longest == 30
    assert seen[-2:] == [(True, 4), (False, 30 + 3)]  # + max_num_seqs
    assert res.row("minillm-unchunked")["same_tokens"] is True
    for method in ("minillm-continuous", "minillm-unchunked"):  # a chunk is no padding
        assert res.row(method)["padding_rows"] == 0
    assert res.info["long_prompts"] == "30 tokens, share 0.5"
    assert res.info["max_num_batched_tokens"] == 4
