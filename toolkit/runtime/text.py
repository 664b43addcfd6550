"""A sequence's text as it streams: UTF-8 safe pieces, stop strings found and held back."""

from __future__ import annotations

import codecs


class TextStream:
    """Feed token bytes; get the text that is safe to show. A character may span tokens (the
    incremental decoder waits for it) and a stop string may span pieces (its possible start is held
    back until it is ruled out)."""

    def __init__(self, stop: list[str]):
        self.stop = list(stop)
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.text = ""  # all text shown so far
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """The new text to show after `piece`; sets `stopped` when a stop string appeared (it and
        what follows are dropped)."""
        return self._push(self._dec.decode(piece))

    def finish(self) -> str:
        """The rest at the end: the decoder's last bytes and what was held back."""
        out = self._push(self._dec.decode(b"", final=True))
        if not self.stopped:
            out += self._held
            self.text += self._held
        self._held = ""
        return out

    def _push(self, s: str) -> str:
        if self.stopped or not s:
            return ""
        buf = self._held + s
        if self.stop:
            at = min((i for i in (buf.find(t) for t in self.stop) if i >= 0), default=-1)
            if at >= 0:
                self.stopped, self._held = True, ""
                self.text += buf[:at]
                return buf[:at]
        keep = max((_tail_prefix(buf, t) for t in self.stop), default=0)
        out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out


def _tail_prefix(buf: str, stop: str) -> int:
    """The length of the longest end of `buf` that is a start of `stop` (a stop string maybe beginning)."""
    for n in range(min(len(buf), len(stop) - 1), 0, -1):
        if buf.endswith(stop[:n]):
            return n
    return 0
