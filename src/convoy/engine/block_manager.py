"""KV block pool: allocation, reference counts and automatic prefix caching. No tensors here.

A request's block table maps its token positions to fixed-size blocks of KV slots:

    tokens      [ t0 .. t15 | t16 .. t31 | t32 .. t37 ______ ]    block_size = 16
    block_table [     7     |     2      |      9            ]

A full prompt block is identified by a SHA-256 digest chained with everything before it,
h_i = SHA-256(h_{i-1} || token ids of block i as int64), so equal digests mean equal prefixes.
h_{-1} is 32 zero bytes, or a digest of the request's `cache_salt`: requests with different salts
(tenants) never share a block, requests with the same salt do. (A 64-bit, invertible hash such as
CPython's `hash` would let a crafted prompt collide with another user's prefix and plant its KV
there, vLLM's CVE-2025-25183.) Once a block's
tokens are in the cache its hash is registered; a later request whose prompt starts with the same
blocks takes references on them instead of recomputing them. Freed blocks keep their hash until
they are handed out again (least recently freed first), so a finished prompt's prefix stays
reusable while memory allows.

A block being computed but not yet in the cache is *pending*: the scheduler holds back a request
whose next prompt block is pending for one step and then reuses it (n samples of one prompt, a
shared few-shot header across a batch) instead of computing it a second time. A request never
waits on a lower-priority one: a block pending in a Batch API line (which may stay paused while
interactive work runs) is computed by the interactive request that needs it, which takes the
block's pending mark over.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from convoy.engine.request import Priority, Request

_NO_SALT = bytes(32)


def hash_prompt_blocks(
    token_ids: list[int], block_size: int, cache_salt: str | None = None, variant: bytes = b""
) -> list[bytes]:
    """Chained SHA-256 digests of the full blocks of a prompt, the first one salted if asked.
    `variant`: what else the blocks' K/V depend on (LongRoPE's factor set, by prompt length)."""
    parent = _NO_SALT
    if cache_salt is not None:
        parent = hashlib.sha256(b"convoy cache_salt\0" + cache_salt.encode()).digest()
    if variant:
        parent = hashlib.sha256(b"convoy variant\0" + variant + b"\0" + parent).digest()
    ids = array("q", token_ids)  # every id as 8 bytes, one copy
    step = block_size * ids.itemsize
    data = memoryview(ids).cast("B")
    hashes: list[bytes] = []
    for end in range(step, len(data) + 1, step):
        parent = hashlib.sha256(parent + data[end - step : end]).digest()
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block holds a computed full prompt block


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: insertion order = eviction order (least recently freed first).
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id (computed blocks)
        # block hash -> (req_id, priority) of the sequence computing it
        self._pending: dict[bytes, tuple[str, Priority]] = {}
        self._num_registered: dict[str, int] = {}  # req_id -> prompt blocks registered so far
        self.num_hit_tokens = 0  # prompt tokens served from the prefix cache, since start

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks that hold a prefix of the request's prompt (at least one token is left
        to compute, so the last prompt position still produces logits)."""
        if not self.enable_prefix_caching or req.computes_whole_prompt:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in req.block_hashes[:limit]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def is_prefix_pending(self, req: Request, num_hits: int) -> bool:
        """Is the request's first uncached prompt block being computed by another request of the
        same or a higher priority? (Not worth waiting for: one of a lower priority.)"""
        if not self.enable_prefix_caching or req.computes_whole_prompt:
            return False
        limit = (req.num_tokens - 1) // self.block_size
        if num_hits >= min(limit, len(req.block_hashes)):
            return False
        owner = self._pending.get(req.block_hashes[num_hits])
        return owner is not None and owner[0] != req.req_id and owner[1] <= req.priority

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens, after `cached` prefix blocks.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        cached = cached or []
        num_tokens = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(req.block_table) - len(cached)
        reusable_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if needed > len(self._free) - reusable_free:
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            req.block_table.append(block_id)
        if cached:
            self._num_registered[req.req_id] = len(cached)
            self.num_hit_tokens += len(cached) * self.block_size
        for _ in range(max(needed, 0)):
            req.block_table.append(self._take_free_block())
        self._mark_pending(req)
        return True

    def cache_computed(self, req: Request) -> None:
        """Register the request's prompt blocks whose tokens are now all in the cache."""
        if not self.enable_prefix_caching:
            return
        done = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        start = self._num_registered.get(req.req_id, 0)
        for i in range(start, done):
            block_hash = req.block_hashes[i]
            if self._is_owner(req, block_hash):
                del self._pending[block_hash]
            if block_hash not in self._cached:
                self._cached[block_hash] = req.block_table[i]
                self.blocks[req.block_table[i]].block_hash = block_hash
        self._num_registered[req.req_id] = max(start, done)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks at the end of the table that no position below `num_tokens`
        uses (a rejected draft's): they are the request's own, never registered."""
        keep = -(-num_tokens // self.block_size)
        while len(req.block_table) > keep:
            block = self.blocks[req.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def free(self, req: Request) -> None:
        """Drop the request's references; blocks nobody holds go back to the free list."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        req.block_table = []
        self._num_registered.pop(req.req_id, None)
        for block_hash in req.block_hashes:
            if self._is_owner(req, block_hash):
                del self._pending[block_hash]

    def _take_free_block(self) -> int:
        block_id = next(iter(self._free))
        del self._free[block_id]
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its prefix-cache entry
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _is_owner(self, req: Request, block_hash: bytes) -> bool:
        owner = self._pending.get(block_hash)
        return owner is not None and owner[0] == req.req_id

    def _mark_pending(self, req: Request) -> None:
        # A sequence that scores its prompt computes every block too: its siblings wait for them.
        # A block pending in a lower-priority sequence is taken over: the requests that need it
        # wait for this one instead.
        if not self.enable_prefix_caching:
            return
        num_blocks = min(len(req.block_table), len(req.block_hashes))
        for i in range(self._num_registered.get(req.req_id, 0), num_blocks):
            block_hash = req.block_hashes[i]
            if block_hash in self._cached:
                continue
            owner = self._pending.get(block_hash)
            if owner is None or owner[1] > req.priority:
                self._pending[block_hash] = (req.req_id, req.priority)
