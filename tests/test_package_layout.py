"""The package shows its layers (issue 70, part 7): few modules at the root, a folder per
layer; the module paths from before the move still import, for one release, as the same
module objects."""
import importlib
import pathlib

import pytest

import minillm

PACKAGE = pathlib.Path(minillm.__file__).parent


def test_at_most_ten_modules_at_the_root():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 10, root
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert {"model", "quant", "perf", "kernels", "kv", "engine", "serve"} <= folders


@pytest.mark.parametrize("old", sorted(minillm.MOVED))
def test_an_old_module_path_is_the_moved_module(old):
    moved = importlib.import_module(minillm.MOVED[old])
    assert importlib.import_module(old) is moved
    assert moved.__name__ == minillm.MOVED[old]  # its own name stays the new one


def test_the_modules_that_became_packages_still_hand_out_their_names():
    from minillm.model import StepMeta, Transformer
    from minillm.model.transformer import Transformer as T
    from minillm.perf import measure_bandwidth
    from minillm.quant import MODES, quantize
    assert Transformer is T and StepMeta and measure_bandwidth and MODES and quantize
    with pytest.raises(AttributeError, match="minillm.quant' has no attribute 'nope'"):
        minillm.quant.nope


def test_no_other_name_is_taken():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("minillm.nowhere")
