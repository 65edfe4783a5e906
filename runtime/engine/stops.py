"""Stop strings: request limits, the engine's search, and the server's held-back tail.

Every piece here costs time linear in the NEW text, never in (stop count x text length), so a
request with many long stop strings cannot stall the engine thread or the event loop:

- `MAX_STOP_STRINGS` / `MAX_STOP_STRING_CHARS` bound a request's stop list (SamplingParams refuses
  more, which the server answers with a 400 naming the limit). OpenAI allows 4 stop strings;
  these limits are generous but keep the per-token work bounded (at most 64 x 1024 characters).
- `find_stop` (engine thread, once per token) searches only the newly decoded text plus the
  `max_stop_len - 1` characters before it: a stop string that ends in the new text starts there,
  and one that ended earlier was found by an earlier call.
- `StopPrefixMatcher` tracks, per stop string, the longest suffix of the text that is a proper
  prefix of that stop string (a KMP automaton fed only the new characters), which is how much
  text a stream must hold back; `StopHoldBack` (engine thread, once per delta output) hands a
  growing text out in pieces with that tail held back, so text once sent is never taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 64  # stop strings per request, at most
MAX_STOP_STRING_CHARS = 1024  # characters per stop string, at most


def find_stop(
    text: str, prev_len: int, stops: Sequence[str], max_stop_len: int
) -> tuple[int, str] | None:
    """The earliest stop string ending past text[:prev_len] as (start index, stop), or None.

    Only text[prev_len - (max_stop_len - 1):] is searched; `text[:prev_len]` must already have
    been checked (by the previous call) and found free of stop strings.
    """
    if not stops or len(text) <= prev_len:
        return None
    lo = max(0, prev_len - (max_stop_len - 1))
    window = text[lo:]
    best: tuple[int, str] | None = None
    for s in stops:
        i = window.find(s)
        if i >= 0 and (best is None or (i, s) < best):
            best = (i, s)
    return None if best is None else (lo + best[0], best[1])


def _extend_failure(s: str, f: list[int]) -> None:
    """Append the next entry of s's KMP prefix function to `f` (f[i] = length of the longest
    proper border of s[:i + 1]); f starts as [0] and grows only as far as a match gets."""
    i = len(f)
    k, c = f[i - 1], s[i]
    while k and s[k] != c:
        k = f[k - 1]
    if s[k] == c:
        k += 1
    f.append(k)


class StopPrefixMatcher:
    """Longest suffix of a growing text that is a proper prefix of one of `stops`.

    Construction is O(stop count): each stop string's KMP prefix function is computed lazily,
    only as far as the text has matched it. `feed` costs O(new characters x stops), amortized,
    and never looks at text it was already given. Stop strings of one character have no
    non-empty proper prefix and are skipped.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if len(s) > 1]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._fail: list[list[int]] = [[0] for _ in self.stops]  # grown by _extend_failure
        self._state = [0] * len(self.stops)  # per stop: matched prefix length, < len(stop)
        self.steps = 0  # automaton transitions taken (for tests: work done)

    def reset(self) -> None:
        self._state = [0] * len(self.stops)

    def feed(self, new_text: str) -> int:
        """Append `new_text`; return how many trailing characters may begin a stop string."""
        if not self.stops:
            return 0
        if len(new_text) >= self.max_len:
            # The answer depends on the last max_len - 1 characters only.
            self.reset()
            new_text = new_text[len(new_text) - (self.max_len - 1) :]
        state = self._state
        for j, s in enumerate(self.stops):
            q, f, n = state[j], self._fail[j], len(s)
            for c in new_text:
                while q and s[q] != c:
                    q = f[q - 1]
                    self.steps += 1
                if s[q] == c:
                    q += 1
                    if q > len(f):  # first time this deep into s: one more prefix-function entry
                        _extend_failure(s, f)
                    if q == n:  # a whole stop string: keep its longest proper border
                        q = f[n - 1]
                self.steps += 1
            state[j] = q
        return max(state)

    @property
    def held(self) -> int:
        """The current answer of `feed` (0 before any text)."""
        return max(self._state, default=0)


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string
    (one-shot; looks at the last `max stop length - 1` characters of `text` only)."""
    m = StopPrefixMatcher(stops)
    return m.feed(text[max(0, len(text) - m.max_len + 1) :]) if m.stops else 0


class StopHoldBack:
    """Hands out a growing text piece by piece, holding back (until the request ends) a tail
    that may be the start of a stop string: the engine cuts a stop string only once it is
    complete, and a piece already sent cannot be taken back. O(new text x stops) per call."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._matcher = StopPrefixMatcher(stops) if stops else None
        self._fed = 0  # characters of the text given to the matcher
        self.sent = 0  # characters of the text handed out

    def take(self, text: str, final: bool) -> str:
        """The part of `text` (the whole text so far) not handed out yet and safe to hand out;
        `final`: the request has ended, so nothing is held back."""
        end = len(text)
        if not final and self._matcher is not None:
            if end > self._fed:
                self._matcher.feed(text[self._fed :])
                self._fed = end
            end -= self._matcher.held
        end = max(end, self.sent)
        piece, self.sent = text[self.sent : end], end
        return piece
