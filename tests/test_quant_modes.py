"""Each quantization mode is one record (issue 70, part 4): its layer, whether it takes
group_size, its own check, whether load_model builds it; chapter 2's QUANTIZATIONS holds
exactly the modes that can be built on load."""
import pytest
import torch

from minillm.model.loader import QUANTIZATIONS
from minillm.quant.int8 import MODES, QuantMode, quantize


def test_every_mode_is_one_record():
    names = sorted(MODES)  # chapter 5's and its appendix's (loaded on first use)
    assert {"w8a16", "w8a8", "fbgemm", "bnb-int8", "int8", "int4", "int8-a8",
            "int4-a8", "int8-a8-tiles"} <= set(names)
    assert all(isinstance(MODES[m], QuantMode) for m in names)
    assert sorted(m for m in names if MODES[m].on_load) == sorted(QUANTIZATIONS)
    assert sorted(m for m in names if MODES[m].grouped) == [
        "int4", "int4-a8", "int8-a8", "int8-a8-tiles", "w8a16"]


def test_the_record_decides_what_quantize_allows():
    linear = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(ValueError, match=r"only the modes \['int4', 'int4-a8', "
                                         r"'int8-a8', 'int8-a8-tiles', 'w8a16'\]"):
        quantize(linear, "w8a8", group_size=32, skip=())
    with pytest.raises(ValueError, match="mode 'int8-a8' takes None"):  # its check
        quantize(linear, "int8-a8", group_size=64, skip=())
    assert type(quantize(linear, "int8", skip=())[0]) is MODES["int8"].layer
