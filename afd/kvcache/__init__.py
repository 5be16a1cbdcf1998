"""Paged KV cache: a pure-Python block manager, the pooled cache tensors, per-step metadata."""

from afd.kvcache.block_manager import BlockManager, OutOfBlocksError
from afd.kvcache.cache import PagedKVCache
from afd.kvcache.metadata import PAGE_TOKENS, AttentionMetadata, DecodePages, PrefillChunk, SeqChunk, build_attention_metadata, last_token_rows

__all__ = [
    "PAGE_TOKENS",
    "AttentionMetadata",
    "DecodePages",
    "PrefillChunk",
    "BlockManager",
    "OutOfBlocksError",
    "PagedKVCache",
    "SeqChunk",
    "build_attention_metadata",
    "last_token_rows",
]
