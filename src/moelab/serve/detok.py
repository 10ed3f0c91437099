"""Incremental detokenization: text deltas as tokens arrive, with stop strings.

Holds back an incomplete UTF-8 character (a byte-level tokenizer decodes it to U+FFFD until
its last byte arrives) and any suffix that could still grow into a stop string, so a streamed
client never receives text that is later retracted. OpenAI semantics: the text ends just
before the first stop string, which is not returned.
"""

from __future__ import annotations

from moelab.data import Tokenizer


class Detokenizer:
    """Feed token ids one by one; get the text each one makes safe to emit."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] | list[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # decoded text without a trailing incomplete character
        self.emitted = 0  # characters of ``text`` handed out
        self.stopped = False

    def push(self, token: int) -> tuple[str, str, bool]:
        """Add ``token``; return ``(delta, token_text, stopped)``.

        ``delta`` is the text now safe to emit, ``token_text`` the characters this token
        completed (before any stop-string cut; "" while a character is incomplete), and
        ``stopped`` True when a stop string matched (``delta`` then ends before it).
        """
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        while full.endswith("\ufffd"):
            full = full[:-1]
        token_text = full[len(self.text) :] if full.startswith(self.text) else full
        self.text = full
        if self.stop:
            lo = max(0, self.emitted - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (full.find(s, lo) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = full[self.emitted : cut]
                self.text, self.emitted, self.stopped = full[:cut], cut, True
                return delta, token_text, True
        safe = len(full) - self._held(full)
        delta = full[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta, token_text, False

    def flush(self) -> str:
        """The held-back text once the sequence has ended without a stop string."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids) if self.ids else ""
        self.text = full
        delta = full[self.emitted :]
        self.emitted = len(full)
        return delta

    def _held(self, full: str) -> int:
        """Length of the longest suffix of ``full`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(full)), best, -1):
                if full.endswith(s[:n]):
                    best = n
                    break
        return best
