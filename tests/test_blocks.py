"""minillm.kv.blocks (chapter 6): the block manager's invariants hold after every
operation of long random runs (hypothesis' stateful testing), a shared prefix block always
holds the tokens its hash names, and everything is free once every request has ended."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm.kv.blocks import BlockManager, check_block_size


@pytest.mark.parametrize("bad", [0, -4, 3, 12, 2.0, "16", True, None])
def test_block_size_must_be_a_positive_power_of_two(bad):
    with pytest.raises(ValueError, match="block_size"):
        check_block_size(bad)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, bad)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", True])
def test_num_blocks_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(bad, 16)


def test_a_new_block_only_when_the_last_is_full():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    tokens = list(range(5))  # 2 blocks: 4 + 1
    assert bm.allocate("a", tokens) == 0
    assert len(bm.tables["a"]) == 2 and bm.num_free == 6
    for n in range(6, 9):  # positions 5..7 fit in the second block
        tokens.append(n)
        assert bm.can_append("a", len(tokens))
        bm.append_slot("a", tokens)
        assert len(bm.tables["a"]) == 2
    tokens.append(9)  # position 8 starts a third block
    bm.append_slot("a", tokens)
    assert len(bm.tables["a"]) == 3 and bm.num_free == 5
    bm.free("a")
    bm.check()
    assert bm.num_free == 8 and bm.tables == {}


def test_prefix_blocks_are_shared_and_survive_their_owner():
    bm = BlockManager(8, 4)
    system = list(range(100, 108))           # two full blocks
    assert bm.allocate("a", system + [1, 2]) == 0
    bm.publish()                             # a's prefill ran: its full blocks are named
    first_two = bm.tables["a"][:2]
    assert bm.allocate("b", system + [3]) == 8  # both blocks found: 8 tokens skipped
    assert bm.tables["b"][:2] == first_two and bm.ref_count[first_two[0]] == 2
    bm.free("a")
    bm.free("b")
    bm.check()
    assert bm.num_free == 8
    assert bm.allocate("c", system + [4, 5, 6]) == 8  # freed, but still cached
    assert bm.tables["c"][:2] == first_two
    assert bm.hits == 4 and bm.queries == 6


def test_the_last_token_is_always_computed():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(8)))
    bm.publish()
    assert bm.allocate("b", list(range(8))) == 4  # not 8: the last block is recomputed
    assert bm.tables["b"][0] == bm.tables["a"][0] != bm.tables["b"][1]


def test_blocks_of_an_unfinished_forward_are_never_shared():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(9)))
    bm.free("a")  # e.g. its prefill failed: the K/V were never written
    bm.publish()
    assert bm.allocate("b", list(range(9))) == 0
    assert bm.cached == {} or all(bm.hash_of[b] == h for h, b in bm.cached.items())


def test_least_recently_freed_blocks_are_reused_first():
    bm = BlockManager(4, 2)
    bm.allocate("old", [1, 2, 3])
    bm.publish()
    bm.free("old")
    bm.allocate("new", [7, 8])
    bm.publish()
    bm.free("new")
    bm.allocate("big", [9, 9, 9])  # 2 blocks: the one never used, then old's last
    assert bm.tables["big"] == [3, 1]
    assert bm.allocate("again", [1, 2, 5]) == 2  # old's first block is still cached
    assert bm.tables["again"] == [0, 2]  # ... and new's block, the last one left
    bm.check()


class BlockMachine(RuleBasedStateMachine):
    """Random allocate / append / preempt / free / publish, as a scheduler does them.
    `content` plays the KV memory: which token each slot of each block holds."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=4)
        self.tokens: dict[str, list[int]] = {}     # running requests: all their tokens
        self.content: dict[int, list] = {b: [None] * 4 for b in range(12)}
        self.written: dict[str, int] = {}          # tokens whose K/V are in the blocks
        self.next_id = 0

    def write(self, rid: str, start: int, end: int) -> None:
        table = self.bm.tables[rid]
        for p in range(start, end):
            self.content[table[p // 4]][p % 4] = self.tokens[rid][p]
        self.written[rid] = end

    @rule(prefix=st.sampled_from([[], [5, 6, 7, 8], [5, 6, 7, 8, 9, 1, 2, 3]]),
          tail=st.lists(st.integers(1, 4), min_size=1, max_size=9))
    def add(self, prefix, tail):
        tokens = prefix + tail
        rid = f"r{self.next_id}"
        self.next_id += 1
        if not self.bm.can_allocate(tokens):
            return
        computed = self.bm.allocate(rid, tokens)
        table = self.bm.tables[rid]
        for p in range(computed):  # a cache hit: the block must hold exactly these
            assert self.content[table[p // 4]][p % 4] == tokens[p]
        self.tokens[rid] = tokens
        self.write(rid, computed, len(tokens))  # the prefill writes the rest

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(1, 4))
    def decode(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.tokens[rid].append(token)
        if self.bm.can_append(rid, len(self.tokens[rid])):
            self.bm.append_slot(rid, self.tokens[rid])
            self.write(rid, len(self.tokens[rid]) - 1, len(self.tokens[rid]))
        else:  # preempted: its blocks go back, its tokens are computed again later
            self.bm.free(rid)
            del self.tokens[rid]

    @rule()
    def publish(self):  # a forward finished: what it wrote may be shared
        self.bm.publish()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.publish()  # its last step ran
        self.bm.free(rid)
        del self.tokens[rid]

    @invariant()
    def consistent(self):
        self.bm.check()
        held = {b for t in self.bm.tables.values() for b in t}
        assert len(held) + self.bm.num_free == self.bm.num_blocks
        assert set(self.bm.tables) == set(self.tokens)
        for rid, tokens in self.tokens.items():
            assert len(self.bm.tables[rid]) == self.bm.blocks_for(len(tokens))

    def teardown(self):
        for rid in list(self.tokens):
            self.bm.free(rid)
        self.bm.check()
        assert self.bm.num_free == self.bm.num_blocks and self.bm.tables == {}


BlockMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60,
                                          deadline=None)
test_block_manager_random_runs = BlockMachine.TestCase


def test_each_full_block_of_a_request_is_hashed_once(monkeypatch):
    """A request's block hashes are chained and its tokens only grow, so each block is
    hashed once. Before, a 320-token request cost 172 SHA-256 calls for 21 blocks (all
    hashed again whenever one filled), and a waiting prompt was hashed every step."""
    import hashlib

    import minillm.kv.blocks as blocks_module
    from minillm.engine import LLMEngine
    from minillm.model.loader import load_model
    from minillm.sampling import SamplingParams
    from minillm.utils import bundled_model_path
    model = load_model(bundled_model_path())
    engine = LLMEngine(model, max_num_seqs=1, kv_cache="paged", block_size=16,
                       num_blocks=64, max_model_len=384)
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(blocks_module.hashlib, "sha256",
                        lambda data: (calls.append(data), real(data))[1])
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    engine.add_request(list(range(1, 161)), params, request_id="a")  # 10 blocks
    engine.add_request(list(range(200, 232)), params, request_id="b")  # waits: 2
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps > 300  # b waited through all of a's steps
    # a: 10 prompt blocks, then 9 filled while decoding (its last token is sampled and
    # never written); b: 2 + 9. Each hashed exactly once (b while it waited, too).
    assert len(calls) == (10 + 9) + (2 + 9)
    assert len(set(calls)) == len(calls)
    assert not engine.kv.blocks.request_keys  # forgotten with the requests
