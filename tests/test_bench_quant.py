"""minillm.bench.quant (chapter 5's INT8 benchmark): bytes, speed and quality per mode on
the bundled model and a tiny random one, CSV files that read back, every argument checked
before any work, and the 7B check's sharded writer and loader on a small preset.
Short runs; no timed asserts."""
import csv
import json
import math
import os

import pytest
import torch

from minillm.bench import quant as bq
from minillm.bench.cli import torch_threads
from minillm.memory import parameter_count
from minillm.quant.int8 import Int8Linear
from minillm.utils import bundled_model_path, repo_root

FAST = dict(new_tokens=4, prompt_tokens=8, repeats=1, device="cpu", progress=False)
COLUMNS = ("mode", "linear_MiB", "linear_vs_fp16", "model_MiB", "ttft_ms", "per_token_ms",
           "tok_s", "peak_MiB", "perplexity", "agreement", "speedup", "perplexity_change",
           "same_tokens")


@pytest.fixture(scope="module")
def bundled():
    with torch_threads(1):
        return bq.run_quant_benchmark(bundled_model_path(), ("float32", "w8a16", "w8a8"),
                                      **FAST)


@pytest.fixture(scope="module")
def tiny(folder):
    with torch_threads(1):
        return bq.run_quant_benchmark(folder, **FAST)  # the default: every mode


def available():
    return tuple(m for m in bq.QUANT_MODES if not bq.mode_missing(m, torch.device("cpu")))


def test_rows_and_columns(bundled, tiny):
    assert [r["mode"] for r in bundled.rows] == ["float32", "w8a16", "w8a8"]
    assert [r["mode"] for r in tiny.rows] == list(available())
    for row in bundled.rows + tiny.rows:
        assert tuple(row) == COLUMNS
        assert row["ttft_ms"] > 0 and row["per_token_ms"] > 0
        assert row["tok_s"] == pytest.approx(1e3 / row["per_token_ms"])
        assert row["peak_MiB"] is None  # CPU: no allocator statistics
        assert 0 <= row["agreement"] <= 1
    assert bundled.row("float32")["speedup"] == 1.0
    assert bundled.ratio("float32", "w8a16") == pytest.approx(
        bundled.row("float32")["per_token_ms"] / bundled.row("w8a16")["per_token_ms"])
    with pytest.raises(KeyError, match="fbgemm"):
        bundled.row("fbgemm")
    assert bundled.info["model"] == "tiny-shakespeare" and bundled.info["device"] == "cpu"
    assert bundled.info["threads"] == 1 and bundled.info["repeats"] == 1
    assert "8-token prompt + 4 new tokens" in bundled.describe()


def test_bytes(bundled, tiny):
    float32, w8a16, w8a8 = (bundled.row(m) for m in ("float32", "w8a16", "w8a8"))
    assert float32["linear_vs_fp16"] == pytest.approx(2.0)
    for row in (w8a16, w8a8):
        assert row["linear_vs_fp16"] <= 0.52
        assert row["model_MiB"] < 0.6 * float32["model_MiB"]
    # tiny model: int8 [out, in] + a float32 scale per output channel, no bias
    for row in tiny.rows:
        if row["mode"] not in ("float32", "float16"):
            expected = (64 + 4) / (2 * 64)
            assert row["linear_vs_fp16"] == pytest.approx(expected, rel=0.02), row["mode"]
    if "float16" in [r["mode"] for r in tiny.rows]:
        assert tiny.row("float16")["linear_vs_fp16"] == pytest.approx(1.0)


def test_quality_on_the_bundled_model(bundled):
    float32, w8a16, w8a8 = (bundled.row(m) for m in ("float32", "w8a16", "w8a8"))
    assert 1 < float32["perplexity"] < 4096
    assert abs(w8a16["perplexity"] / float32["perplexity"] - 1) <= 0.001
    assert w8a16["perplexity_change"] == pytest.approx(
        w8a16["perplexity"] / float32["perplexity"] - 1)
    assert float32["agreement"] == 1.0
    assert w8a16["agreement"] >= 0.99 and w8a8["agreement"] >= 0.97
    assert bundled.info["agreement_on"] == "held-out tokens"
    assert bundled.info["perplexity_tokens"] == 4096
    assert bundled.info["agreement_tokens"] == 512


def test_a_model_without_tokenizer_has_no_perplexity(tiny):
    assert all(math.isnan(r["perplexity"]) for r in tiny.rows)
    assert tiny.info["agreement_on"] == "random token ids"
    assert tiny.info["agreement_tokens"] == 128  # the tiny model's whole context
    assert tiny.row("float32")["agreement"] == 1.0


def test_csv_written_and_read_back(bundled, tmp_path):
    (path,) = bq.write_quant_csv(bundled, tmp_path / "out")
    assert path.name == "quant_tiny-shakespeare_cpu.csv"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["float32", "w8a16", "w8a8"]
    for row, original in zip(rows, bundled.rows):
        assert float(row["per_token_ms"]) == pytest.approx(original["per_token_ms"],
                                                          abs=1e-6)
        assert float(row["linear_vs_fp16"]) == pytest.approx(original["linear_vs_fp16"],
                                                            abs=1e-6)
        assert row["peak_MiB"] == ""
        assert row["hardware"] == bundled.info["hardware"]
        assert row["torch"] == torch.__version__ and row["threads"] == "1"
    assert "w8a16" in bq.format_quant_table(bundled)


def test_command_line_writes_the_csv(folder, tmp_path, capsys):
    out = tmp_path / "results"
    status = bq.main(["--model", str(folder), "--modes", "float32", "w8a16", "--new-tokens",
                      "3", "--prompt-tokens", "4", "--repeats", "1", "--threads", "1",
                      "--out", str(out)])
    assert status == 0
    path = out / "quant_tiny-model_cpu.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["float32", "w8a16"]
    assert rows[0]["new_tokens"] == "3" and rows[0]["model"] == "tiny model"
    assert f"wrote {path}" in capsys.readouterr().out


def no_work(*args, **kwargs):
    raise AssertionError("the model was loaded before the arguments were checked")


BAD = [
    (dict(new_tokens=1), "new_tokens=1"),
    (dict(prompt_tokens=0), "prompt_tokens=0"),
    (dict(repeats=0), "repeats=0"),
    (dict(repeats=True), "repeats=True"),
    (dict(modes=()), "modes=()"),
    (dict(modes=("float32", "int4")), "int4"),
    (dict(modes=("w8a16", "w8a16")), "different names"),
    (dict(prompt_tokens=500, new_tokens=20), "context of 512"),
    (dict(device="tpu"), "tpu"),
]


@pytest.mark.parametrize("bad, message", BAD)
def test_bad_arguments_are_refused_before_any_work(bad, message, monkeypatch):
    monkeypatch.setattr(bq, "load_model", no_work)
    args = {**FAST, "modes": ("float32", "w8a16"), **bad}
    with pytest.raises(ValueError, match=message):
        bq.run_quant_benchmark(bundled_model_path(), **args)


def test_bad_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(bq, "load_model", no_work)
    with pytest.raises((ValueError, FileNotFoundError)):
        bq.run_quant_benchmark(tmp_path / "nothing here", **FAST)


def test_unavailable_modes(folder, monkeypatch):
    monkeypatch.setattr(bq, "load_model", no_work)
    monkeypatch.setattr(bq, "bnb_missing", lambda: "bitsandbytes is not installed")
    with pytest.raises(ValueError, match="'bnb-int8' cannot run here: bitsandbytes"):
        bq.run_quant_benchmark(folder, ("float32", "bnb-int8"), **FAST)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="fbgemm runs on the CPU only"):
            bq.run_quant_benchmark(folder, ("fbgemm",), **{**FAST, "device": "cuda"})
    monkeypatch.undo()
    monkeypatch.setattr(bq, "bnb_missing", lambda: "bitsandbytes is not installed")
    with torch_threads(1):  # the default list drops the mode and says why
        result = bq.run_quant_benchmark(folder, **FAST)
    assert "bnb-int8" not in [r["mode"] for r in result.rows]
    assert result.info["skipped"] == "bnb-int8: bitsandbytes is not installed"
    assert "skipped: bnb-int8" in bq.format_quant_table(result)


@pytest.mark.parametrize("argv", [
    ["--new-tokens", "1"], ["--repeats", "0"], ["--threads", "0"],
    ["--model", "no-such-model"], ["--model", "Qwen2.5-7B"],
    ["--seven-b", "--preset", "Qwen2.5-7B"], ["--seven-b", "--preset", "GPT-9"]])
def test_command_line_refuses_bad_arguments(argv, tmp_path, monkeypatch):
    monkeypatch.setattr(bq, "load_model", no_work)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        bq.main(argv + ["--out", str(out)])
    assert stop.value.code == 2
    assert not any(out.glob("*.csv"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """SmolLM2-135M's shape, random float16, in shards of at most 50 MB; records the
    bytes of every save_file call."""
    import safetensors.torch as st
    saved = []
    original = st.save_file

    def spy(tensors, path, metadata=None):
        saved.append(sum(t.nbytes for t in tensors.values()))
        return original(tensors, path, metadata=metadata)
    st.save_file = spy
    try:
        path = bq.sharded_random_folder("SmolLM2-135M",
                                        tmp_path_factory.mktemp("ckpt") / "smol",
                                        shard_bytes=50 * 10**6)
    finally:
        st.save_file = original
    return path, saved


def test_sharded_writer_never_holds_the_whole_model(sharded):
    path, saved = sharded
    names = dict(bq.hf_names(bq.PRESETS["SmolLM2-135M"]))
    total = sum(math.prod(shape) * 2 for shape in names.values())
    assert len(saved) >= 5 and sum(saved) == total
    embed = math.prod(names["model.embed_tokens.weight"]) * 2  # 56.6 MB: a shard alone
    assert all(size <= 50 * 10**6 or size == embed for size in saved)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(names)
    assert "lm_head.weight" not in names  # SmolLM2 ties its embeddings
    assert index["metadata"]["total_size"] == total
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values()))
    assert not [p for p in path.parent.iterdir() if p != path]  # no temp folder left
    mtime = os.path.getmtime(path / "model.safetensors.index.json")
    again = bq.sharded_random_folder("SmolLM2-135M", path, shard_bytes=50 * 10**6)
    assert again == path  # the same recipe: reused, not rewritten
    assert os.path.getmtime(path / "model.safetensors.index.json") == mtime


def test_seven_b_check_on_a_small_preset(sharded):
    path, _ = sharded
    with torch_threads(1):
        check = bq.seven_b_check("cpu", "SmolLM2-135M", prompt_tokens=8, kv_tokens=16,
                                 folder=path, repeats=1)
    assert check["int8_layers"] == 30 * 7  # every linear layer but the tied lm_head
    assert check["peak_GB"] is None and check["memory_ok"] is None  # CPU
    assert check["ttft_s"] > 0 and isinstance(check["ttft_ok"], bool)
    params = bq.PRESETS["SmolLM2-135M"]
    linear = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
    embed = params["vocab_size"] * 576 * 2
    assert check["weights_GB"] * 1e9 == pytest.approx(linear + embed, rel=0.05)
    assert check["weights_GB"] * 1e9 < 0.65 * parameter_count(params) * 2
    assert check["kv_cache_GB"] * 1e9 == 2 * 30 * 17 * 3 * 64 * 2  # 16 rows + a spare
    model = bq.load_model(path, dtype=torch.float32, device="cpu", quantization="int8")
    assert isinstance(model.layers[0].mlp.down_proj, Int8Linear)
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.int8


@pytest.mark.parametrize("bad, message", [
    (dict(kv_tokens=8), "kv_tokens=8"), (dict(prompt_tokens=0), "prompt_tokens=0"),
    (dict(preset="Qwen2.5-7B"), "Llama shapes"), (dict(kv_tokens=10**6), "context"),
    (dict(device="tpu"), "tpu")])
def test_seven_b_check_refuses_bad_arguments(bad, message, tmp_path, monkeypatch):
    monkeypatch.setattr(bq, "load_model", no_work)
    args = {"device": "cpu", "preset": "SmolLM2-135M", "prompt_tokens": 8,
            "kv_tokens": 16, "folder": tmp_path / "ckpt", **bad}
    with pytest.raises(ValueError, match=message):
        bq.seven_b_check(**args)
    assert not (tmp_path / "ckpt").exists()


def test_recorded_reference_data():
    """The book's reference runs (python -m minillm.bench quant --out data/benchmarks)."""
    folder = repo_root() / "data" / "benchmarks"
    paths = sorted(folder.glob("quant_*.csv"))
    assert {p.name for p in paths} >= {"quant_bundled_cpu.csv",
                                       "quant_smollm2-135m_cpu.csv"}
    for path in paths:
        with open(path, newline="") as f:
            rows = {r["mode"]: r for r in csv.DictReader(f)}
        assert rows["float32"]["speedup"] == "1.0"
        for mode in ("w8a16", "w8a8"):
            assert float(rows[mode]["linear_vs_fp16"]) <= 0.52
    with open(folder / "quant_bundled_cpu.csv", newline="") as f:
        rows = {r["mode"]: r for r in csv.DictReader(f)}
    ratio = float(rows["w8a16"]["perplexity"]) / float(rows["float32"]["perplexity"])
    assert abs(ratio - 1) <= 0.001 and float(rows["w8a16"]["agreement"]) >= 0.99
