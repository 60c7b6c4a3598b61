"""Incremental detokenization with stop strings.

Text is decoded over a short window of tokens (prefix offset / read offset, as in TGI
and vLLM), so a token that only completes a multi-byte UTF-8 character together with
the next one emits nothing until the character is whole, and SentencePiece-style
(Metaspace) leading spaces come out right. Stop strings are matched on the text, so
they may span tokens; any text that could still be the start of a stop string is held
back and released once it cannot be, or at the end. Invariant: the concatenated
deltas equal the final text, which equals `decode(token_ids)` cut before the first stop
string.

Cost: the window's prefix text is decoded once per advance and cached, and tokens that
arrive together (the outputs of several steps merged when the caller fell behind) are
decoded as one window: two decodes per call instead of two per token, so a caller that
falls behind catches up.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=...)` (a `tokenizers.Tokenizer`).
        stop: stop strings; the first one found ends the text (it is not included).
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
    """

    def __init__(self, tokenizer: Decoder, stop: list[str] | tuple[str, ...] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string was found; text is final
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text: str | None = ""  # decode of token_ids[prefix_offset:read_offset]; None: stale
        self._num_sent = 0

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens (one, or several that arrived together); return the text that is
        now safe to emit ("" if none)."""
        if self.stopped:
            return ""
        if token_ids:
            self.token_ids.extend(token_ids)
            if not self._advance() and len(token_ids) > 1:
                # The window ends inside a character: advance token by token, as far as
                # whole characters go.
                end = len(self.token_ids)
                for stop in range(end - len(token_ids) + 1, end):
                    self._advance(stop)
        return self._emit(final=False)

    def _advance(self, end: int | None = None) -> bool:
        """Append the text of tokens [read_offset, end) if it ends on a whole character."""
        ids = self.token_ids
        end = len(ids) if end is None else end
        if end <= self._read_offset:
            return False
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(ids[self._prefix_offset : end])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = end
            self._prefix_text = None
            return True
        return False

    def flush(self) -> str:
        """At the end of the request: release held-back and incomplete text."""
        if not self.stopped:
            full = self._decode(self.token_ids)
            if full.startswith(self.text):
                self.text = full
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        hold = 0
        if self._stop and not self.stopped:
            cut = -1
            for s in self._stop:
                i = self.text.find(s, self._num_sent)
                if i >= 0 and (cut < 0 or i < cut):
                    cut = i
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
            elif not final:
                hold = self._stop_prefix_len()
        end = len(self.text) - hold
        delta = self.text[self._num_sent : end]
        self._num_sent = end
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest unsent suffix of the text that starts some stop string."""
        text = self.text
        for k in range(min(self._max_stop_len - 1, len(text) - self._num_sent), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
