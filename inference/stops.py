"""Stop strings across token boundaries, sans-IO.

Text that might be the start of a stop string is held back until the next text shows whether
it is; text that is certainly not part of one is released at once.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    __slots__ = ("_pending", "_stops", "matched")

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._pending = ""
        # The stop string that ended generation (Anthropic's stop_sequence reports it).
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Feed generated text; return (text safe to emit, whether a stop string was hit).

        Once a stop string is hit, the text before it is returned and generation must end;
        the stop string itself is never emitted (OpenAI semantics).
        """
        if not self._stops:
            return text, False
        pending = self._pending + text
        # The occurrence that *ends* first is the one a token-by-token stream would have
        # completed first; choosing it makes the result independent of how text is chunked
        # (it matters when one stop string lies inside another).
        first: tuple[int, int] | None = None
        for stop in self._stops:
            index = pending.find(stop)
            if index >= 0 and (first is None or (index + len(stop), index) < first):
                first = (index + len(stop), index)
                self.matched = stop
        if first is not None:
            self._pending = ""
            return pending[: first[1]], True
        hold = self._longest_stop_prefix_suffix(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        """Held-back text, when generation ended for another reason."""
        rest, self._pending = self._pending, ""
        return rest

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
