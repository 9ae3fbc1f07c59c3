"""minillm.perf: GPU peak table lookup and memory-bandwidth utilisation."""
import pytest

from minillm.perf import GPU_PEAKS, mbu, peak_for


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
