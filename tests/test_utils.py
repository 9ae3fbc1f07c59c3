"""minillm.utils (chapter 0): pick_device gives the device asked for, or a clear error when
this machine does not have it. GPUs are simulated by patching torch's queries, so the
tests mean the same on a laptop and on a GPU machine."""
import pytest
import torch

from minillm.utils import bundled_model_path, pick_device, repo_root, synchronize


@pytest.fixture
def machine(monkeypatch):
    """Pretend this machine has `gpus` CUDA GPUs and (or not) an Apple GPU."""
    def set_up(gpus: int = 0, mps: bool = False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    return set_up


def test_default_is_cuda_when_there_is_a_gpu(machine):
    machine(gpus=0)
    assert pick_device() == torch.device("cpu")
    machine(gpus=2)
    assert pick_device() == torch.device("cuda")


@pytest.mark.parametrize("prefer,expected", [
    ("cpu", "cpu"), ("cuda", "cuda"), ("cuda:0", "cuda:0"), ("cuda:1", "cuda:1"),
    (torch.device("cuda", 1), "cuda:1"), (torch.device("cpu"), "cpu"), ("mps", "mps"),
])
def test_devices_this_machine_has(machine, prefer, expected):
    machine(gpus=2, mps=True)
    assert pick_device(prefer) == torch.device(expected)


@pytest.mark.parametrize("prefer,gpus,mps,match", [
    ("cuda", 0, False, "no CUDA GPU"),
    ("cuda:0", 0, False, "no CUDA GPU"),
    ("cuda:2", 2, False, "allowed indices are 0 to 1"),
    ("cuda:99", 1, False, "'cuda:99'"),
    (torch.device("cuda", 3), 2, False, "cuda:3"),
    ("mps", 1, False, "MPS"),
    ("meta", 1, True, "'meta'"),
    (torch.device("meta"), 1, True, "meta"),
    ("gpu", 1, False, "'gpu'"),
    ("CUDA", 1, False, "'CUDA'"),
    ("cuda ", 1, False, "'cuda '"),
    ("cuda:-1", 1, False, "'cuda:-1'"),
    ("cuda:x", 1, False, "'cuda:x'"),
    ("xpu", 1, False, "'xpu'"),
    ("cpu:1", 0, False, "'cpu:1'"),
    ("", 0, False, "''"),
    (0, 1, False, "prefer=0"),
    (True, 1, False, "prefer=True"),
])
def test_devices_this_machine_lacks_are_a_clear_error(machine, prefer, gpus, mps, match):
    machine(gpus=gpus, mps=mps)
    with pytest.raises(ValueError, match=match) as error:
        pick_device(prefer)
    assert "allowed" in str(error.value) or "use 'cpu'" in str(error.value)


def test_synchronize_waits_for_the_device_it_is_given(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    assert calls == []  # nothing to wait for: CPU work is done when the call returns
    synchronize("cuda:1")
    synchronize(torch.device("mps"))
    assert calls == ["cuda:1", "mps"]


def test_bundled_model_is_found():
    assert (repo_root() / "minillm" / "utils.py").is_file()
    assert (bundled_model_path() / "config.json").is_file()
