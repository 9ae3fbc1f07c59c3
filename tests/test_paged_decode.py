"""minillm.kernels.paged_decode (chapter 7's appendix, §5): decode attention that reads the
paged pool in place. The page-by-page reference and the C++ kernel give gather +
PyTorch's attention; the kernel checks every read before it starts; the engine's
attention_backend="in_place" gives the gather path's greedy tokens in float32."""
import pytest
import torch
import torch.nn.functional as F

from helpers import drive, make_model_pair
from minillm.engine import LLMEngine
from minillm.engine.compiled import CompiledForward
from minillm.kernels.paged_decode import PagesInPlace, attend_pages, paged_decode
from minillm.sampling import SamplingParams

torch.set_num_threads(2)


def pool(blocks, bs, kv_heads, d, dtype=torch.float32):
    return torch.randn(2, blocks * bs, kv_heads, d).to(dtype).unbind(0)


def gathered(q, k, v, table, length, bs):
    """One row, chapter 6's way: its positions copied, then PyTorch's attention."""
    slots = torch.tensor([int(b) * bs + i for b in table for i in range(bs)][:length])
    kv_heads, (H, d) = k.shape[1], q.shape
    k_all, v_all = k[slots].transpose(0, 1).float(), v[slots].transpose(0, 1).float()
    out = F.scaled_dot_product_attention(q.float().view(kv_heads, H // kv_heads, d),
                                         k_all, v_all)
    return out.reshape(H, d)


@pytest.mark.parametrize("kv_heads,G,d", [(2, 3, 16), (1, 1, 8), (4, 2, 32)])
def test_the_page_by_page_reference_is_gather_plus_attention(kv_heads, G, d):
    torch.manual_seed(kv_heads)
    k, v = pool(12, 4, kv_heads, d)
    q = torch.randn(kv_heads * G, d) * 4  # wide scores: the max moves between pages
    for table, length in [([11, 0, 5, 3], 13), ([2], 1), ([7, 8], 8), ([1, 9, 4], 9)]:
        want = gathered(q, k, v, table, length, 4)
        assert torch.allclose(attend_pages(q, k, v, table, length, 4), want, atol=1e-5)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("kv_heads,G", [(3, 3), (2, 1)])
def test_the_kernel_gives_the_reference_on_rows_of_any_length(d, kv_heads, G):
    torch.manual_seed(d + G)
    bs, blocks = 16, 64
    k, v = pool(blocks, bs, kv_heads, d)
    lengths = [1, 17, 128, 129, 300]  # one chunk, a part, the chunk edge, several chunks
    tables = torch.stack([torch.randperm(blocks)[:19] for _ in lengths])
    q = torch.randn(len(lengths), kv_heads * G, d) * 3
    out = paged_decode(q, k, v, tables, torch.tensor(lengths), bs)
    for i, n in enumerate(lengths):
        want = gathered(q[i], k, v, tables[i].tolist(), n, bs)
        assert torch.allclose(out[i], want, atol=1e-5), (n, (out[i] - want).abs().max())


def test_the_operator_runs_the_cpu_kernel_and_pytorch_elsewhere():
    # paged_decode loads the kernel: the operator's CPU kernel, in C++. Its PyTorch
    # body (attend_pages per row) is what runs where the kernel is not registered.
    from minillm.kernels.paged_decode import _pages_in_pytorch
    torch.manual_seed(1)
    k, v = pool(16, 8, 3, 64)
    q, tables = torch.randn(2, 9, 64), torch.stack([torch.randperm(16) for _ in "ab"])
    lengths = torch.tensor([5, 77])
    out = paged_decode(q, k, v, tables, lengths, 8)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("minillm::paged_decode", "CPU")
    body = _pages_in_pytorch(q, k, v, tables, lengths, 8)
    assert torch.allclose(out, body, atol=1e-5) and not torch.equal(out, body)


def test_the_kernel_in_bfloat16_rounds_once():
    torch.manual_seed(0)
    k, v = pool(32, 16, 3, 64, torch.bfloat16)
    table = torch.randperm(32)[None, :20]
    q = (torch.randn(1, 9, 64) * 3).bfloat16()
    out = paged_decode(q, k, v, table, torch.tensor([310]), 16)
    exact = gathered(q[0], k, v, table[0].tolist(), 310, 16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0], exact.bfloat16()) or \
        (out[0].float() - exact).abs().max() <= exact.abs().max() * 2 ** -7


@pytest.mark.parametrize("change,message", [
    (dict(lengths=[0]), "length 0 outside 1..64"),
    (dict(lengths=[65]), "length 65 outside 1..64"),
    (dict(table=[[0, 9, 1, 2]]), "block 9 outside the pool"),
    (dict(table=[[0, -1, 1, 2]]), "block -1 outside the pool"),
    (dict(d=48), "head_dim 48; this kernel takes 32, 64, 128"),
])
def test_the_kernel_checks_every_read_before_it_starts(change, message):
    d = change.get("d", 32)
    k, v = pool(8, 16, 2, d)
    table = torch.tensor(change.get("table", [[0, 3, 1, 2]]))
    lengths = torch.tensor(change.get("lengths", [40]))
    with pytest.raises(RuntimeError, match=message):
        paged_decode(torch.randn(1, 4, d), k, v, table, lengths, 16)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny random Llama with head_dim 32, one the kernel is built for."""
    return make_model_pair(tmp_path_factory.mktemp("heads32"), hidden_size=128)[1]


def arrivals():
    return [(i % 3, [1] + list(range(5 + 9 * i, 8 + 13 * i)),
             SamplingParams(temperature=0, max_tokens=5 + 4 * i, ignore_eos=True))
            for i in range(5)]


def test_in_place_gives_the_gather_tokens_in_float32(wide_heads):
    """... with one compiled decode step per batch size (the kernel is span-free),
    where the gather compiles one per span its rows reach."""
    served, spans = {}, {}
    for backend in ("gather", "in_place"):
        engine = LLMEngine(wide_heads, max_num_seqs=4, kv_cache="paged",
                           max_model_len=128, block_size=8, compile_decode=True,
                           attention_backend=backend)
        runner = engine.runner.forward
        assert isinstance(runner, CompiledForward) and runner.attention == backend
        assert isinstance(runner.step_kv, PagesInPlace) == (backend == "in_place")
        served[backend] = [r.seq.output_ids for r in drive(engine, arrivals()).values()]
        assert sum(runner.used.values()) > 10  # decode steps went through it
        spans[backend] = {span for _, span, _ in runner.steps}
    assert served["gather"] == served["in_place"]
    assert spans["in_place"] == {128} and len(spans["gather"]) > 1


def test_the_option_and_its_checks(llama, wide_heads):
    with pytest.raises(ValueError, match=r"attention_backend='flash': allowed \['gather', 'in_place'\]"):
        LLMEngine(wide_heads, compile_decode=True, attention_backend="flash")
    with pytest.raises(ValueError, match="needs compile_decode=True"):
        LLMEngine(wide_heads, kv_cache="paged", attention_backend="in_place")
    with pytest.raises(ValueError, match="head_dim 16: use attention_backend='gather'"):
        LLMEngine(llama[1], kv_cache="paged", compile_decode=True,
                  attention_backend="in_place")
    with pytest.raises(ValueError, match="this pool: SlotKVCache"):
        LLMEngine(wide_heads, kv_cache="slots", compile_decode=True,
                  attention_backend="in_place")
    default = LLMEngine(wide_heads, kv_cache="paged",
                        compile_decode=True).runner.forward
    assert default.attention == "gather" and default.step_kv is default.kv
