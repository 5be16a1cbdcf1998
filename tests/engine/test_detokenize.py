"""Incremental detokenization (``Tokenizer.decode_more``) equals decoding every token from scratch, at
every step, for a byte-level BPE (the built-in model's) and a Llama-style SentencePiece tokenizer
(Metaspace, byte fallback) -- multi-byte characters split across tokens included."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from afd.cli.common import BUILTIN_MODEL
from afd.engine.tokenizer import DecodeState, Tokenizer

CORPUS = ["To be, or not to be: that is the question.", "Ça va? Naïve café — déjà vu.", "日本語のテキスト。", "emoji 🙂🚀 ok"] * 20


@pytest.fixture(scope="module")
def llama_style(tmp_path_factory):
    """A small SentencePiece-style BPE: '▁' for spaces, unknown characters as <0xNN> byte tokens."""
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS[:3], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *bytes_]))  # no emoji learnt
    d = tmp_path_factory.mktemp("llama_tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({}))
    return Tokenizer(d)


@pytest.fixture(scope="module")
def byte_level():
    return Tokenizer(BUILTIN_MODEL)


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(CORPUS))
def test_incremental_decode_equals_full_decode_at_every_step(byte_level, llama_style, text):
    for tok in (byte_level, llama_style):
        ids = tok.encode(text, add_special_tokens=False)
        state = DecodeState()
        for i in range(1, len(ids) + 1):
            assert tok.decode_more(ids[:i], state) == tok.decode(ids[:i]), (text, i)
        assert state.read <= len(ids) and state.prefix <= state.read
