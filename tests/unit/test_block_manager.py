"""Block manager: allocation, reference counts, prefix caching (no model, no torch)."""

from __future__ import annotations

import hashlib
from array import array

from convoy.engine.block_manager import BlockManager, hash_prompt_blocks
from convoy.engine.request import Request
from convoy.sampling_params import SamplingParams

BS = 4


def _req(req_id: str, tokens: list[int], **params: object) -> Request:
    req = Request(req_id, tokens, SamplingParams(**params), group_id=req_id, arrival=0.0)  # type: ignore[arg-type]
    req.block_hashes = hash_prompt_blocks(tokens, BS, req.params.cache_salt)
    return req


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(8, BS)
    a = _req("a", list(range(10)))
    assert bm.allocate(a, 10)
    assert len(a.block_table) == 3 and bm.num_used_blocks == 3
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2)  # 12 tokens still fit in 3 blocks
    assert len(a.block_table) == 3
    a.num_computed_tokens = 12
    assert bm.allocate(a, 1)
    assert len(a.block_table) == 4
    bm.free(a)
    assert bm.num_used_blocks == 0 and a.block_table == []


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(3, BS)
    a = _req("a", list(range(8)))
    assert bm.allocate(a, 8)
    b = _req("b", list(range(100, 108)))
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and bm.num_used_blocks == 2


def test_prefix_hit_shares_blocks_and_ref_counts() -> None:
    bm = BlockManager(16, BS)
    header = list(range(8))
    a = _req("a", header + [50, 51, 52])
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_computed(a)
    b = _req("b", header + [60, 61])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens - 8, hits)
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[hits[0]].ref_count == 2
    bm.free(a)
    assert bm.blocks[hits[0]].ref_count == 1 and bm.num_used_blocks == 3
    bm.free(b)
    assert bm.num_used_blocks == 0
    # Freed blocks keep their hash: a third request still hits them.
    c = _req("c", header + [70])
    assert len(bm.get_computed_blocks(c)) == 2


def test_hit_never_covers_the_whole_prompt() -> None:
    bm = BlockManager(16, BS)
    a = _req("a", list(range(8)))
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_computed(a)
    # Same 8 tokens: only the first block may come from the cache, the last token must be computed.
    assert len(bm.get_computed_blocks(_req("b", list(range(8))))) == 1


def test_pending_block_holds_back_the_second_request() -> None:
    bm = BlockManager(16, BS)
    a = _req("a", list(range(12)))
    b = _req("b", list(range(12)))
    assert bm.allocate(a, 12)
    assert bm.is_prefix_pending(b, 0)
    a.num_computed_tokens = 12
    bm.cache_computed(a)
    assert not bm.is_prefix_pending(b, len(bm.get_computed_blocks(b)))


def test_eviction_reuses_cached_free_blocks() -> None:
    bm = BlockManager(3, BS)
    a = _req("a", list(range(8)))
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_computed(a)
    bm.free(a)
    b = _req("b", list(range(100, 112)))
    assert bm.allocate(b, 12)  # needs all three blocks: the cached ones are evicted
    assert bm.get_computed_blocks(_req("c", list(range(9)))) == []


def test_prompt_logprobs_requests_bypass_the_cache() -> None:
    bm = BlockManager(16, BS)
    a = _req("a", list(range(9)))
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_computed(a)
    assert bm.get_computed_blocks(_req("b", list(range(9)), prompt_logprobs=0)) == []


def _cached(bm: BlockManager, req_id: str, tokens: list[int], **params: object) -> Request:
    """A request whose prompt is computed and registered in the prefix cache."""
    req = _req(req_id, tokens, **params)
    assert bm.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_computed(req)
    return req


def test_block_keys_are_chained_sha256_digests() -> None:
    tokens = list(range(10))
    keys = hash_prompt_blocks(tokens, BS)
    assert len(keys) == 2  # the partial last block has no key
    first = hashlib.sha256(bytes(32) + array("q", tokens[:4]).tobytes()).digest()
    assert keys[0] == first
    assert keys[1] == hashlib.sha256(first + array("q", tokens[4:8]).tobytes()).digest()
    # A different first block changes every later key, though the later tokens are the same.
    other = hash_prompt_blocks([99] + tokens[1:], BS)
    assert other[0] != keys[0] and other[1] != keys[1]
    # Large token ids are keyed in full (no truncation to a small int).
    assert hash_prompt_blocks([2**40] * 4, BS) != hash_prompt_blocks([0] * 4, BS)


def test_cache_salt_isolates_prefixes() -> None:
    bm = BlockManager(32, BS)
    header = list(range(8))
    _cached(bm, "a", header + [50], cache_salt="tenant-a")
    assert len(bm.get_computed_blocks(_req("same", header + [60], cache_salt="tenant-a"))) == 2
    assert bm.get_computed_blocks(_req("other", header + [60], cache_salt="tenant-b")) == []
    assert bm.get_computed_blocks(_req("unsalted", header + [60])) == []
    # ... and the other way round: an unsalted prefix serves unsalted requests only.
    _cached(bm, "b", header + [70])
    assert len(bm.get_computed_blocks(_req("plain", header + [80]))) == 2
    assert bm.get_computed_blocks(_req("salted", header + [80], cache_salt="tenant-b")) == []
    assert hash_prompt_blocks(header, BS, "x") != hash_prompt_blocks(header, BS, "y")


def test_hit_tokens_are_counted() -> None:
    bm = BlockManager(16, BS)
    header = list(range(8))
    _cached(bm, "a", header + [1])
    assert bm.num_hit_tokens == 0
    b = _req("b", header + [2])
    hits = bm.get_computed_blocks(b)
    assert bm.allocate(b, 1, hits)
    assert bm.num_hit_tokens == 8
