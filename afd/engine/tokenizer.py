"""Tokenizer over ``tokenizer.json`` (the ``tokenizers`` library), with the checkpoint's BOS rule.

Matches ``transformers.AutoTokenizer`` for the checkpoint: the post-processor in
``tokenizer.json`` decides special tokens; when ``tokenizer_config.json`` says
``add_bos_token: true`` and the post-processor does not add it, the BOS token is
prepended (what transformers' Llama-style fast tokenizers do).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: afd needs the checkpoint's tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template: str | None = cfg.get("chat_template")
        probe = self._tok.encode("", add_special_tokens=True).ids
        self._prepend_bos = bool(
            cfg.get("add_bos_token") and self.bos_token_id is not None and probe[:1] != [self.bos_token_id]
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (e.g. "Ġthe" in byte-level BPE), not its decoded text."""
        return self._tok.id_to_token(token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_more(self, ids: list[int], state: "DecodeState", skip_special_tokens: bool = True) -> str:
        """``decode(ids)`` for a token list that only grows, decoding a window of recent tokens per call
        instead of everything (O(n) over a request, not O(n^2)).

        The window starts at a token after which the text was complete (``state.prefix``): its decode
        minus that of the already-committed tokens (``prefix..read``) is the new text. A tail that ends
        in an incomplete UTF-8 character (U+FFFD) is returned but never committed, so later tokens can
        complete it (the window grows while they do not).

        Equal to ``decode(ids)`` at every step for byte-level BPE (DeepSeek, Qwen). For SentencePiece
        byte fallback it is equal whenever the text ends in a complete character; while one is
        incomplete (or on invalid bytes) a full decode turns the whole run of byte tokens into U+FFFD,
        where this keeps the characters of the run that were already complete."""
        prefix = self.decode(ids[state.prefix : state.read], skip_special_tokens)
        tail = self.decode(ids[state.prefix :], skip_special_tokens)[len(prefix) :]
        if not tail.endswith("\ufffd"):  # also when the new tokens decode to nothing (skipped specials)
            state.text += tail
            state.prefix, state.read = state.read, len(ids)
            tail = ""
        return state.text + tail


@dataclass(slots=True)
class DecodeState:
    """Where :meth:`Tokenizer.decode_more` stands on one growing token list."""

    text: str = ""  # committed text: the decode of ids[:read]
    prefix: int = 0  # the decode window starts here
    read: int = 0


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value
