"""Paged KV cache: a pure-Python block manager, the pooled cache tensors, per-step metadata."""

from afd.kvcache.block_manager import BlockManager, OutOfBlocksError
from afd.kvcache.cache import PagedKVCache
from afd.kvcache.metadata import AttentionMetadata, SeqChunk, build_attention_metadata, last_token_rows

__all__ = [
    "AttentionMetadata",
    "BlockManager",
    "OutOfBlocksError",
    "PagedKVCache",
    "SeqChunk",
    "build_attention_metadata",
    "last_token_rows",
]
