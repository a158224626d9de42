"""New tokens to new text for streaming: whole characters only, and cut at the first stop string.

``push(token)`` returns the text the token adds that is safe to send: held back while the decoded text ends
inside a multi-byte character (``\\ufffd``), while it is not an extension of what was sent (a tokenizer may
rewrite the end of its text as tokens arrive), and while its end could be the start of a stop string. Once a
stop string appears the text ends just before it (``stopped``) and nothing more is sent. ``flush`` returns
the rest when the generation ended, so the deltas always add up to ``text``.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # what was sent
        self.stopped = False

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _cut(self, text: str) -> str | None:
        """``text`` up to its first stop string, or None when it has none (looked for past what was sent)."""
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return text[:min(hits)] if hits else None

    def _held(self, text: str) -> int:
        """How many characters at the end of ``text`` could begin a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token))
        text = self._decoded()
        cut = self._cut(text) if self.stop else None
        if cut is not None:
            self.stopped = True
            return self._send(cut)
        if text.endswith("\ufffd"):
            return ""
        return self._send(text[:len(text) - self._held(text)])

    def flush(self) -> str:
        """The text not sent yet, at the end of the generation."""
        if self.stopped:
            return ""
        text = self._decoded()
        cut = self._cut(text) if self.stop else None
        if cut is not None:
            self.stopped = True
            text = cut
        if not text.startswith(self.text):  # the tokenizer rewrote what was sent: nothing can be taken back
            return ""
        return self._send(text)

    def _send(self, upto: str) -> str:
        if not upto.startswith(self.text) or len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text):]
        self.text = upto
        return delta
