"""Stop strings (``stop``, ``-r/--reverse-prompt``) over streamed text."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStrings"]


class StopStrings:
    """Cuts generated text at the first stop string, holding back what might begin one."""

    def __init__(self, stops: Sequence[str] | str | None):
        if isinstance(stops, str):
            stops = [stops]
        self.stops = [s for s in (stops or []) if s]
        self.text = ""
        self.emitted = 0
        self.hit = False

    def push(self, piece: str) -> str:
        """Add ``piece``; return the text that is now safe to emit."""
        self.text += piece
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.emitted - len(stop)))
            if at != -1:
                self.hit = True
                self.text = self.text[:at]
                break
        safe = len(self.text)
        if not self.hit:
            for stop in self.stops:
                # the longest suffix of the text that is a proper prefix of this stop string
                for n in range(min(len(stop) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(stop[:n]):
                        safe = min(safe, len(self.text) - n)
                        break
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
