"""BlockManager: ref counting, chained prefix hashes, prefix hits, LRU eviction, slots."""

import pytest

from slimserve.runtime.engine.block_manager import BlockManager, block_hash, hash_blocks
from slimserve.runtime.engine.sequence import SamplingParams, Sequence


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def _prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit seq and compute its whole prompt in one step, as the scheduler + engine would."""
    hit = bm.allocate_prefix(seq)
    n = seq.num_tokens - seq.num_computed_tokens
    assert bm.can_append(seq, n)
    bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)
    return hit


def test_chained_hash_distinguishes_equal_blocks_at_different_prefixes():
    block = tuple(range(4))
    assert block_hash(None, block) != block_hash(block_hash(None, (9, 9, 9, 9)), block)
    # [A, X] and [B, X]: the second blocks hold the same tokens but hash differently.
    a = hash_blocks([1, 2, 3, 4, 7, 7, 7, 7], 4)
    b = hash_blocks([5, 6, 7, 8, 7, 7, 7, 7], 4)
    assert len(a) == len(b) == 2 and a[1] != b[1]
    assert hash_blocks([1, 2, 3, 4, 7, 7, 7, 7, 1, 2], 4) == a  # a partial tail is not hashed

    bm = BlockManager(num_blocks=8, block_size=4)
    _prefill(bm, _seq("a", [1, 2, 3, 4, 7, 7, 7, 7, 0]))
    # Same second block behind a different first block: no hit at all.
    assert bm.allocate_prefix(_seq("b", [5, 6, 7, 8, 7, 7, 7, 7, 0])) == 0


def test_prefix_hit_shares_only_full_blocks_and_counts_hit_rate():
    bm = BlockManager(num_blocks=16, block_size=16)
    prompt = list(range(100, 140))  # 40 tokens: blocks 0, 1 full, block 2 partial
    a = _seq("a", prompt)
    assert _prefill(bm, a) == 0 and a.num_cached_tokens == 0
    b = _seq("b", prompt[:35] + [1, 2, 3, 4, 5])  # diverges inside block 2
    assert bm.allocate_prefix(b) == 32
    assert (
        b.block_table == a.block_table[:2]
        and b.num_computed_tokens == 32
        and b.num_cached_tokens == 32
    )
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 1]
    # b's new tokens go into a fresh block of its own, never into a's partial block 2.
    bm.append_slots(b, b.num_tokens - 32)
    assert b.block_table[2] not in a.block_table and bm.ref_count(b.block_table[2]) == 1
    assert bm.prefix_cache_hit_rate == pytest.approx(32 / 80)


def test_never_hits_the_whole_sequence():
    bm = BlockManager(num_blocks=8, block_size=4)
    _prefill(bm, _seq("a", list(range(8))))  # two full cached blocks
    b = _seq("b", list(range(8)))
    # Both blocks are cached, but the last token must be computed to get logits: hit 1 block.
    assert bm.allocate_prefix(b) == 4 and b.num_computed_tokens == 4
    assert bm.lookup_prefix(_seq("c", list(range(9)))) == 8


def test_uncomputed_blocks_are_not_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq("a", list(range(12)))
    bm.allocate_prefix(a)
    bm.append_slots(a, 12)
    a.num_computed_tokens = 6  # a chunked prefill computed only 6 tokens so far
    bm.commit(a)
    assert bm.lookup_prefix(_seq("b", list(range(12)))) == 4
    a.num_computed_tokens = 12
    bm.commit(a)
    assert bm.lookup_prefix(_seq("c", list(range(13)))) == 12


def test_ref_counting_with_shared_blocks_and_free():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = _seq("a", list(range(10))), _seq("b", list(range(10)))
    _prefill(bm, a)
    _prefill(bm, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and bm.usage == pytest.approx(4 / 6)
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert [bm.ref_count(x) for x in shared] == [1, 1]  # still held by b
    assert bm.usage == pytest.approx(3 / 6)
    bm.free(b)
    assert bm.usage == 0 and bm.num_free_blocks == 6
    # Freed full blocks stay cached: a third request still hits them.
    assert bm.allocate_prefix(_seq("c", list(range(10)))) == 8


def test_lru_evicts_least_recent_cached_block_tail_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a_tokens, b_tokens = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    a, b = _seq("a", a_tokens), _seq("b", b_tokens)
    _prefill(bm, a)  # exactly 2 blocks, both full and cached
    _prefill(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.usage == 0  # all 4 evictable, none plain free
    c = _seq("c", [0, 0, 0])
    bm.allocate_prefix(c)
    bm.append_slots(c, 3)  # evicts the LRU block: a's tail (a was freed first, tail first)
    assert bm.lookup_prefix(_seq("a2", a_tokens + [0])) == 4
    assert bm.lookup_prefix(_seq("b2", b_tokens + [0])) == 8
    # A hit refreshes recency: touch b's blocks, release them; now a's head is the LRU.
    b2 = _seq("b2", b_tokens + [0])
    bm.allocate_prefix(b2)
    bm.free(b2)
    d = _seq("d", [0, 0, 0])
    bm.allocate_prefix(d)
    bm.append_slots(d, 3)
    assert bm.lookup_prefix(_seq("a3", a_tokens + [0])) == 0
    assert bm.lookup_prefix(_seq("b3", b_tokens + [0])) == 8


def test_plain_free_blocks_are_taken_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq("a", list(range(8)))
    _prefill(bm, a)
    bm.free(a)
    c = _seq("c", [7, 7, 7, 7, 7, 7, 7])
    bm.allocate_prefix(c)
    bm.append_slots(c, 7)  # 2 blocks: exactly the 2 never-cached ones
    assert bm.lookup_prefix(_seq("a2", list(range(9)))) == 8
    # c holds 2 blocks (8 slots); the 2 evictable ones cover up to 16 tokens in all.
    assert bm.can_append(c, 16) and not bm.can_append(c, 17)


def test_can_allocate_counts_evictable_hits_as_taken():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = _seq("a", list(range(8)))
    _prefill(bm, a)
    bm.free(a)  # 2 cached evictable + 1 free
    b = _seq("b", list(range(12)))
    # b hits 2 blocks (8 tokens); 4 more tokens need 1 block, and 1 is left after the hits.
    assert bm.can_allocate(b, 4) and not bm.can_allocate(b, 5)
    assert bm.allocate_prefix(b) == 8
    bm.append_slots(b, 4)
    assert bm.usage == 1.0


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = _seq("a", list(range(8)))
    _prefill(bm, a)
    bm.free(a)
    assert bm.allocate_prefix(_seq("b", list(range(9)))) == 0
    assert bm.prefix_cache_hit_rate == 0.0


def test_reset_prefix_cache_forgets_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq("a", list(range(8)))
    _prefill(bm, a)
    bm.free(a)
    bm.allocate_prefix(_seq("b", list(range(9))))
    assert bm.prefix_cache_hit_rate > 0
    bm.reset_prefix_cache()
    assert bm.prefix_cache_hit_rate == 0.0
    assert bm.lookup_prefix(_seq("c", list(range(9)))) == 0


def test_slot_mapping():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq("s", list(range(6)))
    s.block_table = [5, 2]  # tokens 0-3 in block 5, tokens 4-5 in block 2
    assert [bm.slot(s, i) for i in range(6)] == [20, 21, 22, 23, 8, 9]


def test_bad_sizes_raise_with_the_value():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
