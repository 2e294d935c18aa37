"""Blocks: the pool that hands out block ids, per-request block tables, and chained prefix hashes."""

from kvplane.blocks.hashing import ROOT_HASH, block_hashes
from kvplane.blocks.pool import BlockPool
from kvplane.blocks.table import BlockTable

__all__ = ["ROOT_HASH", "BlockPool", "BlockTable", "block_hashes"]
