"""One request's output text as its tokens arrive: incremental decode, stop strings, what may be streamed.

The rules are vLLM's. Stop strings are searched only after ``min_tokens``, and are cut from the text unless
``include_stop_str_in_output``. An EOS or stop token ends the text without its own text (with it, if
``include_stop_str_in_output``). Until the end, the streamable text holds back an incomplete UTF-8 character
at the tail, and the last ``len(longest stop) - 1`` characters, in which a stop string may be forming.

Offline, the engine keeps one per request (afd/engine/llm_engine.py). A server's engine core sends token ids
only, and the front end keeps one per stream in the HTTP process (afd/serving/frontend.py). So the text is
worked out by this class alone, wherever it is worked out.
"""

from __future__ import annotations

from afd.config import SamplingParams
from afd.engine.tokenizer import DecodeState, Tokenizer


class OutputText:
    __slots__ = ("tokenizer", "params", "ids", "text", "decoded", "sent", "_hold")

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.ids: list[int] = []
        self.text = ""  # the output text so far (cut at a stop string once one is found)
        self.decoded = DecodeState()
        self.sent = 0  # characters already handed out by piece()
        self._hold = 0 if params.include_stop_str_in_output else max((len(s) for s in params.stop), default=1) - 1

    def add(self, token: int, ends_by_token: bool = False) -> str | None:
        """Append ``token``; returns the stop string it completed, if any. ``ends_by_token``: the request
        ends with this token (EOS or a stop token), whose text joins only with include_stop_str_in_output."""
        self.ids.append(token)
        p = self.params
        if ends_by_token:
            if p.include_stop_str_in_output:
                self._decode()
            return None
        checked = len(self.decoded.text)  # text up to here is final and was searched for stop strings
        self._decode()
        if not p.stop or len(self.ids) <= p.min_tokens:
            return None
        start = max(0, checked - max(len(s) for s in p.stop) + 1)  # a stop string may straddle it
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in p.stop) if i >= 0]
        if not hits:
            return None
        at, s = min(hits)
        self.text = self.text[: at + len(s) if p.include_stop_str_in_output else at]
        return s

    def piece(self, done: bool) -> str:
        """Text not handed out before that may be streamed now (everything, once ``done``)."""
        text = self.text
        if not done:
            text = text.rstrip("\ufffd")
            text = text[: max(0, len(text) - self._hold)]
        out = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return out

    def _decode(self) -> None:
        self.text = self.tokenizer.decode_more(self.ids, self.decoded, self.params.skip_special_tokens)
