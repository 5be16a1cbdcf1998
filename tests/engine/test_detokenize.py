"""Incremental detokenization (``Tokenizer.decode_more``) equals decoding every token from scratch: at
every step for byte-level BPE (the built-in model's, as DeepSeek and Qwen use), on any token ids; for a
Llama-style SentencePiece tokenizer (Metaspace, byte fallback), at every step where the text ends in a
complete character -- multi-byte characters split across byte tokens included."""

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
    """A small SentencePiece-style BPE: '▁' for spaces; characters it never learnt become <0xNN> byte
    tokens, which are ordinary vocabulary (as in Llama's tokenizer), so the decoder fuses them."""
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS[:2], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))  # no CJK, no emoji learnt
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    d = tmp_path_factory.mktemp("llama_tok")
    (d / "tokenizer.json").write_text(json.dumps(spec))
    (d / "tokenizer_config.json").write_text(json.dumps({}))
    out = Tokenizer(d)
    assert out.decode(out.encode("日本 🙂", add_special_tokens=False)) == "日本 🙂"  # through byte tokens
    assert len(out.encode("🙂", add_special_tokens=False)) >= 4
    return out


@pytest.fixture(scope="module")
def byte_level():
    return Tokenizer(BUILTIN_MODEL)


def assert_equal_at_every_step(tok: Tokenizer, ids: list[int], only_complete: bool = False) -> None:
    """``only_complete``: compare only where the full decode ends in a complete character (byte
    fallback decodes a run of byte tokens as a whole: U+FFFD for all of it while it is incomplete)."""
    state = DecodeState()
    for i in range(1, len(ids) + 1):
        got, want = tok.decode_more(ids[:i], state), tok.decode(ids[:i])
        if not (only_complete and want.endswith("\ufffd")):
            assert got == want, (ids, i)
    assert state.prefix <= state.read <= len(ids)


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(CORPUS))
def test_incremental_decode_of_text_equals_full_decode(byte_level, llama_style, text):
    assert_equal_at_every_step(byte_level, byte_level.encode(text, add_special_tokens=False))
    assert_equal_at_every_step(llama_style, llama_style.encode(text, add_special_tokens=False), only_complete=True)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2047), max_size=40))
def test_incremental_byte_level_decode_of_any_ids_equals_full_decode(byte_level, ids):
    """Whatever a model samples, invalid UTF-8 and special tokens included."""
    assert_equal_at_every_step(byte_level, [i % byte_level.vocab_size for i in ids])


def test_a_character_completed_after_many_incomplete_ones_is_not_lost(byte_level):
    """Eight tokens that each end inside a character, then the one completing the last: a decoder that
    gave up waiting and committed would print U+FFFD where '日' belongs, for the rest of the request."""
    byte_token = {b: byte_level._tok.token_to_id(_byte_level_char(b)) for b in (0xE6, 0x97, 0xA5)}  # 日 = E6 97 A5
    assert all(t is not None for t in byte_token.values())
    ids = [byte_token[0xE6]] * 8 + [byte_token[0x97], byte_token[0xA5]] + byte_level.encode("a", add_special_tokens=False)
    assert byte_level.decode(ids).endswith("日a")
    assert_equal_at_every_step(byte_level, ids)


def test_tokens_that_decode_to_nothing_still_move_the_window(byte_level):
    eos = byte_level.eos_token_id
    assert eos is not None and byte_level.decode([eos]) == ""
    state = DecodeState()
    ids = byte_level.encode("To be", add_special_tokens=False) + [eos] * 50
    for i in range(1, len(ids) + 1):
        byte_level.decode_more(ids[:i], state)
    assert state.read == len(ids) and state.text == "To be"  # committed: no re-decoding of the whole output


def _byte_level_char(b: int) -> str:
    """GPT-2's byte-to-unicode map: the vocabulary character of one raw byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))
