"""Paged KV cache: a pure-Python block manager (with a sliding-window pool beside it where a model has windows),
the pooled cache tensors, per-step metadata."""

from afd.kvcache.block_manager import BlockManager, OutOfBlocksError
from afd.kvcache.cache import CacheTensor, PagedKVCache, layout_bytes
from afd.kvcache.metadata import PAGE_TOKENS, AttentionMetadata, CompressedSeq, entry_rows, rows_per_block, DecodePages, PrefillChunk, SeqChunk, StateSlots, build_attention_metadata, last_token_rows
from afd.kvcache.windowed import Prefix, WindowedBlocks, make_blocks

__all__ = [
    "PAGE_TOKENS",
    "AttentionMetadata",
    "CompressedSeq",
    "entry_rows",
    "rows_per_block",
    "DecodePages",
    "PrefillChunk",
    "BlockManager",
    "CacheTensor",
    "layout_bytes",
    "OutOfBlocksError",
    "PagedKVCache",
    "Prefix",
    "SeqChunk",
    "StateSlots",
    "WindowedBlocks",
    "make_blocks",
    "build_attention_metadata",
    "last_token_rows",
]
