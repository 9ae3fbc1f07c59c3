"""minillm.bench.decode (chapter 7's decode benchmark): every way gives transformers'
tokens in float32, the ratios and the MBU follow from the times, a preset's random
model has transformers' weights, and bad arguments are refused before any work."""
import csv

import pytest
import torch

from minillm.bench import decode as bench_perf
from minillm.perf.mbu import decode_bytes

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def rows():
    return bench_perf.run_perf_benchmark("bundled", "cpu", prompt_tokens=12,
                                         new_tokens=5, batches=(1, 3), repeats=1,
                                         compile=False).rows


def test_rows_ways_tokens_and_ratios(rows):
    assert [(r["way"], r["batch"]) for r in rows] == [
        ("transformers generate()", 1), ("KV cache loop (ch. 3)", 1),
        ("engine (ch. 4, 6)", 1), ("engine + CUDA graphs (ch. 7)", 1),
        ("engine (ch. 4, 6)", 3), ("engine + CUDA graphs (ch. 7)", 3)]
    one = [r for r in rows if r["batch"] == 1]
    assert all(r["same_tokens_as_transformers"] == 5 for r in one)   # float32: all
    hf_ms = rows[0]["ms_per_token"]
    for r in one:
        assert r["x_transformers"] == pytest.approx(hf_ms / r["ms_per_token"])
        assert r["MBU"] > 0  # checked against decode_bytes in the next test
    for r in rows:
        assert r["ms_per_token"] > 0 and r["tokens_per_s"] > 0
        assert r["dtype"] == "float32" and r["peak_from"] == "measured copy"
    by = {(r["way"], r["batch"]): r for r in rows}
    for way in ("engine (ch. 4, 6)", "engine + CUDA graphs (ch. 7)"):
        assert by[way, 3]["x_batch_1"] == pytest.approx(
            by[way, 3]["tokens_per_s"] / by[way, 1]["tokens_per_s"])
        assert "x_transformers" not in by[way, 3]


def test_engine_ways_count_what_one_decode_step_runs(rows):
    by = {(r["way"], r["batch"]): r for r in rows}
    eager, graphs = by["engine (ch. 4, 6)", 1], by["engine + CUDA graphs (ch. 7)", 1]
    for r in (eager, graphs):  # on a CPU: operations, no launches
        assert r["aten_ops_per_step"] > 100
        assert r["kernel_launches_per_step"] == r["graph_launches_per_step"] == 0
    # no graph on a CPU: the same forward plus the copies into the static buffers
    assert graphs["aten_ops_per_step"] > eager["aten_ops_per_step"]
    for r in rows:  # the loops are not the engine; batch > 1: not profiled
        if r["batch"] > 1 or "engine" not in r["way"]:
            assert "aten_ops_per_step" not in r
    assert "kernels" not in bench_perf.format_table(rows)


def test_table_shows_the_kernel_launches_when_there_are_any(rows):
    gpu = [dict(r) for r in rows]
    for r, n in zip(gpu, (None, None, 600, 3, None, None)):
        if n is not None:
            r["kernel_launches_per_step"] = n
    table = bench_perf.format_table(gpu).splitlines()
    header = next(line for line in table if line.startswith("way"))
    assert header.split()[-1] == "kernels"
    engine_rows = [line.split()[-1] for line in table if "engine" in line]
    assert engine_rows[:2] == ["600", "3"]


def test_mbu_is_bytes_over_time_over_peak(rows):
    from minillm.model.loader import load_model
    from minillm.utils import bundled_model_path
    model = load_model(bundled_model_path(), dtype=torch.float32, device="cpu")
    step = decode_bytes(model, context=12 + 5 // 2)
    for r in rows:
        if r["batch"] == 1:
            expected = step / (r["ms_per_token"] / 1e3) / (r["peak_GB_per_s"] * 1e9)
            assert r["MBU"] == pytest.approx(expected, rel=0.01)  # peak is rounded


def test_preset_model_pair_has_the_same_weights_and_logits():
    # A real preset is too big for a unit test: the same code path with a small shape.
    import transformers
    from minillm.memory import PRESETS
    PRESETS["_test-tiny"] = dict(PRESETS["TinyLlama-1.1B"], num_hidden_layers=2,
                                 hidden_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=300,
                                 intermediate_size=128)
    try:
        ours, hf = bench_perf.model_pair("_test-tiny", torch.float32, torch.device("cpu"))
    finally:
        del PRESETS["_test-tiny"]
    assert isinstance(hf, transformers.LlamaForCausalLM)
    assert next(ours.parameters()).dtype == torch.float32
    ids = torch.tensor([[1, 7, 42, 99, 5]])
    with torch.inference_mode():
        mine = ours(ids, torch.arange(5).unsqueeze(0))
        theirs = hf(ids).logits
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_round_robin_interleaves_the_ways_and_drops_the_first_round():
    log = []

    def way(name, times):
        it = iter(times)
        return lambda: log.append(name) or {"ms_per_token": next(it), "ids": [name],
                                            "seconds": 9.0}
    rows = bench_perf.round_robin({"a": way("a", [100, 1, 3, 2]),
                                   "b": way("b", [50, 5, 6, 7])}, repeats=3)
    assert log == ["a", "b"] * 4
    assert rows == [{"way": "a", "ids": ["a"], "ms_per_token": 2, "first_run_s": 9.0},
                    {"way": "b", "ids": ["b"], "ms_per_token": 6, "first_run_s": 9.0}]


def test_agreement_counts_the_shared_prefix():
    assert bench_perf.agreement([1, 2, 3], [1, 2, 3]) == 3
    assert bench_perf.agreement([1, 9, 3], [1, 2, 3]) == 1
    assert bench_perf.agreement([], [1]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt2"], "model='gpt2'"),
    (["--dtype", "int8"], "dtype='int8'"),
    (["--new-tokens", "1"], "new_tokens=1"),
    (["--batch", "0"], "batches="),
    (["--batch", "4", "4"], "batches="),
    (["--repeats", "0"], "repeats=0"),
    (["--threads", "999"], "--threads=999"),
])
def test_bad_arguments_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_perf.main(argv + ["--device", "cpu", "--no-csv"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_command_writes_one_csv(tmp_path, capsys):
    code = bench_perf.main(["--prompt-tokens", "6", "--new-tokens", "3", "--repeats", "1",
                            "--device", "cpu", "--out", str(tmp_path)])
    assert code == 0
    path = tmp_path / "decode_bundled_cpu.csv"
    with open(path) as f:
        table = list(csv.DictReader(f))
    assert [r["way"] for r in table] == ["transformers generate()", "KV cache loop (ch. 3)",
                                         "engine (ch. 4, 6)",
                                         "engine + CUDA graphs (ch. 7)"]
    assert {r["hardware"] for r in table} and "wrote" in capsys.readouterr().out
