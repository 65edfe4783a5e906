"""Paged KV-cache bookkeeping: fixed-size physical blocks, reference counts and a prefix cache.

The KV cache is `num_blocks` physical blocks of `block_size` token slots each. A sequence owns
an ordered `block_table`; the K/V of its token i live in slot
`block_table[i // block_size] * block_size + i % block_size`.

Prefix caching (vLLM's automatic prefix caching): a FULL block whose K/V have been computed is
registered under its hash `sha256(parent block's hash || its block_size token ids as
little-endian int64)` (the first block's parent is a fixed root digest). Chaining through the
parent makes equal token runs at different prefixes distinct, so a hit on block j implies
blocks 0..j-1 match too. The hash is a cryptographic one, as vLLM uses since GHSA-rm76-4mrf-v9r8:
Python's `hash()` of tuples is deterministic and not collision-resistant, so crafted prompts
could have collided with another request's blocks and been served its K/V.

Salts (vLLM's `cache_salt`): a sequence's `prefix_salt` (runtime/engine/sequence.py: the request's
`cache_salt` and, for a prompt whose KV was imported from a prefill replica, a random secret
drawn at import) replaces the root digest by `sha256(root || "salt" || salt)`, and the chain
carries it to every later block: sequences share blocks only when their salts are equal. So
tenants with different salts never share, and imported blocks (whose K/V this server did not
compute and cannot check) are registered only where the request that imported them can hit
them; a plain request for the same prompt computes its own.
A registered block whose reference count drops to 0 is not freed outright: it goes to an
evictable LRU where a later request can still hit it. Allocation takes never-cached free
blocks first, then evicts the least recently used cached block and forgets its key.

Blocks shared between sequences are always full and computed, so a sequence only ever writes
new K/V into blocks it holds alone (asserted in `append_slots`).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence as _Ints
from dataclasses import dataclass, field

from slimserve.runtime.engine.sequence import Sequence, SequenceStatus

BlockKey = bytes  # a block's chained sha256 digest (32 bytes)

ROOT_HASH = hashlib.sha256(b"slimserve prefix cache root v1").digest()  # parent of block 0


def salted_root(salt: bytes | None) -> bytes:
    """The parent digest of a first block: ROOT_HASH, or for a salted sequence
    sha256(ROOT_HASH || b"salt" || salt)."""
    return ROOT_HASH if salt is None else hashlib.sha256(ROOT_HASH + b"salt" + salt).digest()


def block_hash(
    parent_hash: bytes | None, token_ids: _Ints[int], salt: bytes | None = None
) -> bytes:
    """sha256 digest of one full block given its parent's digest (None for the first block,
    whose parent is `salted_root(salt)`; a later block's parent carries the salt already).

    The encoding is canonical: the 32-byte parent digest, then each token id as a little-endian
    int64, so equal (parent, tokens) always give the same digest, in any process.
    """
    parent = salted_root(salt) if parent_hash is None else parent_hash
    if len(parent) != 32:
        raise ValueError(f"parent_hash must be a 32-byte sha256 digest, got {len(parent)} bytes")
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def hash_blocks(token_ids: list[int], block_size: int, salt: bytes | None = None) -> list[bytes]:
    """Chained digests of the leading full blocks of `token_ids` (a partial tail is skipped)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class _Block:
    block_id: int  # index of the physical block in the KV cache
    ref_count: int = 0  # live sequences whose block_table holds it
    key: BlockKey | None = None  # set while registered in the prefix cache


@dataclass(slots=True)
class _SeqState:
    """Per-sequence hashing state, kept so hashes are computed once per block."""

    # digests of leading full blocks of token_ids
    keys: list[BlockKey] = field(default_factory=list)
    num_committed: int = 0  # leading blocks already offered to the prefix cache


class BlockManager:
    """Allocates KV blocks to sequences, shares cached prefix blocks, evicts cached blocks LRU."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(
                f"num_blocks must be an integer >= 1, got {num_blocks!r}; give the KV cache more memory"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(
                f"block_size must be an integer >= 1, got {block_size!r} (16 is the usual value)"
            )
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; oldest first
        self._cached: dict[BlockKey, int] = {}  # digest -> block id of registered full blocks
        self._seqs: dict[Sequence, _SeqState] = {}  # Sequence hashes by identity (eq=False)
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache (cumulative)
        self.num_hit_tokens = 0  # of those, tokens served from the cache (cumulative)

    # ---- properties -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (0..1); evictable cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served by the prefix cache / prompt tokens looked up (0 before any lookup)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def ref_count(self, block_id: int) -> int:
        """Live sequences holding physical block `block_id`."""
        return self._blocks[block_id].ref_count

    def slot(self, seq: Sequence, i: int) -> int:
        """KV-cache slot of token i of `seq` (its block must already be allocated)."""
        assert 0 <= i < len(seq.block_table) * self._block_size, (i, len(seq.block_table))
        return seq.block_table[i // self._block_size] * self._block_size + i % self._block_size

    # ---- prefix cache -----------------------------------------------------------------------

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._seqs.get(seq)
        if state is None:
            state = self._seqs[seq] = _SeqState()
        return state

    def _keys(self, seq: Sequence, n: int) -> list[BlockKey]:
        """Keys of the first n full blocks of seq.token_ids (fewer if it has fewer full blocks)."""
        keys = self._state(seq).keys
        n = min(n, seq.num_tokens // self._block_size)
        if len(keys) < n:
            tokens, bs = seq.token_ids, self._block_size
            for j in range(len(keys), n):
                keys.append(
                    block_hash(
                        keys[j - 1] if j else None,
                        tokens[j * bs : (j + 1) * bs],
                        None if j else seq.prefix_salt,
                    )
                )
        return keys[:n]

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached run of seq's full blocks, leaving >= 1 token to compute
        (and every position whose logits give a prompt logprob wanted)."""
        if not self.enable_prefix_caching:
            return []
        # (num_tokens - 1) // block_size: the last token must be computed to have logits to sample;
        # with prompt logprobs, every position from prompt_logprobs_start - 1 on must be too.
        computed = seq.num_tokens - 1
        if seq.params.prompt_logprobs is not None:
            computed = min(computed, seq.params.prompt_logprobs_start - 1)
        hits = []
        for key in self._keys(seq, computed // self._block_size):
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup_prefix(self, seq: Sequence) -> int:
        """Tokens of `seq` that `allocate_prefix` would serve from the cache now; changes nothing."""
        return len(self._prefix_hits(seq)) * self._block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a WAITING `seq` without blocks could take its prefix hits plus `num_new_tokens`."""
        assert not seq.block_table, seq.request_id
        hits = self._prefix_hits(seq)
        needed = self._blocks_for(len(hits) * self._block_size + num_new_tokens) - len(hits)
        # Taking a ref on an evictable hit removes it from the pool the new blocks come from.
        reused = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        return needed <= self.num_free_blocks - reused

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a WAITING `seq` without blocks its cached prefix blocks; return the hit tokens.

        Sets seq.block_table and seq.num_computed_tokens (= hit blocks * block_size). On a first
        admission (not a recompute after preemption) it also records seq.num_cached_tokens and
        counts the prompt toward the hit rate, so recomputes do not inflate the rate.
        """
        assert seq.status is SequenceStatus.WAITING and not seq.block_table, seq.request_id
        assert seq.num_computed_tokens == 0, seq.request_id
        hits = self._prefix_hits(seq)
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        hit_tokens = len(hits) * self._block_size
        seq.block_table = list(hits)
        seq.num_computed_tokens = hit_tokens
        self._state(seq).num_committed = len(hits)  # already registered
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(hit_tokens, seq.num_prompt_tokens)
            if self.enable_prefix_caching:
                self.num_queried_tokens += seq.num_prompt_tokens
                self.num_hit_tokens += seq.num_cached_tokens
        return hit_tokens

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s newly full, computed blocks in the prefix cache (call after a step).

        A block whose key another block already holds (two requests computed the same prefix at
        once) stays unregistered and goes to the plain free list when released.
        """
        if not self.enable_prefix_caching:
            return
        state = self._state(seq)
        full = seq.num_computed_tokens // self._block_size
        keys = self._keys(seq, full)
        for j in range(state.num_committed, full):
            block = self._blocks[seq.block_table[j]]
            if block.key is None and keys[j] not in self._cached:
                block.key = keys[j]
                self._cached[keys[j]] = block.block_id
        state.num_committed = max(state.num_committed, full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after a weight reload) and zero the hit-rate counters.

        Blocks held by live sequences stay with them but are never registered again.
        """
        for block_id in self._cached.values():
            self._blocks[block_id].key = None
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self.num_queried_tokens = self.num_hit_tokens = 0

    # ---- allocation -------------------------------------------------------------------------

    def can_allocate_blocks(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks could be taken now (free or evictable)."""
        return num_blocks <= self.num_free_blocks

    def allocate_imported(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Give a `seq` without blocks fresh blocks for `num_tokens` tokens whose K/V are about to
        be copied in (received from a prefill replica, runtime/disagg/); they count as computed.
        Returns the block ids, in order. Nothing is looked up in or counted toward the prefix
        cache. The sequence gets a fresh random `import_salt` first: `commit` registers its
        full blocks after the next step as for any sequence, but under keys no other request
        has (module doc), so K/V this server did not compute never serve anyone else."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq.request_id
        needed = self._blocks_for(num_tokens)
        assert needed <= self.num_free_blocks, (seq.request_id, needed, self.num_free_blocks)
        seq.import_salt = secrets.token_bytes(16)
        self._seqs[seq] = _SeqState()  # keys computed before the salt are not its keys
        seq.block_table = [self._take_block() for _ in range(needed)]
        seq.num_computed_tokens = num_tokens
        return list(seq.block_table)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _take_block(self) -> int:
        """A block with ref 0 -> ref 1: a never-cached one if any, else evict the LRU cached one."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self._blocks[block_id]
            del self._cached[block.key]
            block.key = None
        self._blocks[block_id].ref_count = 1
        return block_id

    def _num_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(
            0, self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        )

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether enough blocks are free to cover `num_new_tokens` more computed tokens."""
        return self._num_missing(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to cover num_computed_tokens + num_new_tokens tokens."""
        missing = self._num_missing(seq, num_new_tokens)
        assert missing <= self.num_free_blocks, (seq.request_id, missing, self.num_free_blocks)
        first = seq.num_computed_tokens // self._block_size
        # The block receiving the first new token, if already held, must be private to seq.
        assert first >= len(seq.block_table) or self._blocks[seq.block_table[first]].ref_count == 1
        seq.block_table.extend(self._take_block() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        """Drop seq's refs on all its blocks; clear its block_table and num_computed_tokens.

        Released blocks go tail-first to the LRU end, so a sequence's last blocks (the least
        shareable) are evicted before its first ones.
        """
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            assert block.ref_count > 0, (seq.request_id, block_id)
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._seqs.pop(seq, None)
