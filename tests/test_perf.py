"""minillm.perf.mbu: GPU peak table lookup and memory-bandwidth utilisation."""
import copy

import pytest

from helpers import compiling
from minillm.perf.mbu import GPU_PEAKS, mbu, peak_for


def test_peak_for_picks_the_longest_matching_name():
    assert peak_for("Tesla T4") == GPU_PEAKS["T4"]
    assert peak_for("NVIDIA A100-SXM4-80GB") == GPU_PEAKS["A100-SXM4-80GB"]
    assert peak_for("NVIDIA A100-PCIE-40GB") == GPU_PEAKS["A100"]
    assert peak_for("NVIDIA H100 PCIe") == GPU_PEAKS["H100 PCIe"]
    assert peak_for("NVIDIA H100 80GB HBM3") == GPU_PEAKS["H100"]
    assert peak_for("NVIDIA H200") == GPU_PEAKS["H200"]
    assert peak_for("Apple M2") is None
    with pytest.raises(ValueError, match="name"):
        peak_for(None)


def test_mbu():
    assert mbu(4.8e12, 1.0, 4.8e12) == 1.0
    assert mbu(13.5e9, 21.6e-3, 4.8e12) == pytest.approx(0.130, abs=1e-3)
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(ValueError):
            mbu(bad, 1.0, 1.0)


def test_measure_bandwidth_is_a_positive_rate_and_refuses_bad_sizes():
    from minillm.perf.mbu import measure_bandwidth
    rate = measure_bandwidth("cpu", nbytes=2**22, repeats=3)
    assert 1e8 < rate < 1e13  # between 0.1 GB/s and 10 TB/s
    for kw in (dict(nbytes=1000), dict(nbytes=2.0**22), dict(repeats=0),
               dict(repeats=True)):
        with pytest.raises(ValueError, match="must be an int"):
            measure_bandwidth("cpu", **kw)


def test_decode_bytes_counts_weights_once_and_one_embedding_row(llama):
    from minillm.perf.mbu import decode_bytes
    from minillm.quant.int8 import quantize
    _, model = llama
    c = model.config
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    row = c.hidden_size * 4
    table = c.vocab_size * row
    assert decode_bytes(model) == params - table + row          # untied: one row read
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert decode_bytes(model, context=10) == decode_bytes(model) + 10 * kv
    tied = type(model)(type(c)(**{**vars(c), "tie_word_embeddings": True}))
    tied_params = sum(p.numel() * p.element_size() for p in tied.parameters())
    assert decode_bytes(tied) == tied_params                    # the head reads it all
    int8 = quantize(copy.deepcopy(model), "w8a16")
    assert decode_bytes(int8) < 0.5 * decode_bytes(model)        # 1 byte vs 4 a weight
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="context"):
            decode_bytes(model, context=bad)


def test_compile_parts_keeps_weights_names_and_logits(llama):
    import torch

    from minillm.engine.graphs import compile_parts
    _, model = llama
    compiled = copy.deepcopy(model)
    with compiling():  # torch.compile really compiled: no silent fallback to eager
        names = compile_parts(compiled)
        c = model.config
        assert len(names) == 3 * c.num_layers + 1 and names[-1] == "norm"
        assert list(compiled.state_dict()) == list(model.state_dict())
        ids = torch.tensor([[1, 5, 9, 13, 2]])
        pos = torch.arange(5).unsqueeze(0)
        with torch.inference_mode():
            torch.testing.assert_close(compiled(ids, pos), model(ids, pos),
                                       rtol=1e-4, atol=1e-4)


def test_quiet_native_stderr_silences_fd_2_and_restores_it(capfd):
    import os

    from minillm.perf.mbu import quiet_native_stderr
    with quiet_native_stderr():
        os.write(2, b"hidden\n")
    os.write(2, b"shown\n")
    assert capfd.readouterr().err == "shown\n"
    with pytest.raises(RuntimeError):
        with quiet_native_stderr():
            raise RuntimeError("the descriptor comes back after an error too")
    os.write(2, b"back\n")
    assert capfd.readouterr().err == "back\n"


def test_launch_counts_adds_every_launch_function_and_nothing_else():
    from types import SimpleNamespace

    from minillm.perf.mbu import KERNEL_LAUNCHES, launch_counts
    events = [("aten::mm", 3), ("aten::add", 2), ("cudaLaunchKernel", 10),
              ("cudaLaunchKernelExC", 4), ("cuLaunchKernel", 5),
              ("cuLaunchKernelEx", 1),
              ("cudaGraphLaunch", 1), ("cudaMemcpyAsync", 7), ("mm_kernel", 9)]
    prof = SimpleNamespace(key_averages=lambda: [
        SimpleNamespace(key=k, count=n) for k, n in events])
    assert set(KERNEL_LAUNCHES) == {k for k, _ in events[2:6]}
    assert launch_counts(prof) == {"aten ops": 5, "kernel launches": 20,
                                   "graph launches": 1}


def test_launch_counts_of_a_cpu_profile_has_ops_and_no_launches():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minillm.perf.mbu import launch_counts, quiet_native_stderr
    x = torch.randn(8, 8)
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        (x @ x).relu().sum()
    counts = launch_counts(prof)
    assert counts["aten ops"] >= 3  # mm, relu, sum (and what they call)
    assert counts["kernel launches"] == counts["graph launches"] == 0
