"""What ``run`` reports on stderr beyond the text: the request id and the figures at
the end with -v (as Ollama's --verbose does), and that an answer was cut off."""

from __future__ import annotations

import sys
import time

from ..protocol import Generate, Tokens, Usage
from .common import Status


class RunStats:
    """What ``run`` says on stderr beyond the text: with -v, the request id first and
    the figures at the end (as Ollama's --verbose); on a terminal or with -v, that an
    answer was cut off."""

    def __init__(self, req: Generate, status: Status) -> None:
        self.req, self.status = req, status
        self.usage: Usage | None = None
        self.started = self.first = self.last = 0.0

    def begin(self) -> None:
        self.started = time.monotonic()
        if self.status.verbose:
            sys.stderr.write(f"everycycle: request {self.req.request_id}\n")

    def tokens(self, event: Tokens) -> None:
        now = time.monotonic()
        if event.chunk.ids and not self.first:
            self.first = now
        self.last = now

    def end(self) -> None:
        u = self.usage
        if u is None:
            return
        if self.status.enabled and u.finish_reason in ("length", "context"):
            why = (f"-n {self.req.max_tokens}" if u.finish_reason == "length"
                   and self.req.max_tokens else "the context is full")
            sys.stderr.write(f"everycycle: (cut off after {u.generated_tokens} tokens: {why})\n")
        if not self.status.verbose:
            return
        ttft = (self.first - self.started) * 1000 if self.first else 0.0
        span = self.last - self.first
        rate = (u.generated_tokens - 1) / span if span > 0 and u.generated_tokens > 1 else 0.0
        drafts = (f"; drafted {u.draft_n}, accepted {u.draft_n_accepted or 0} "
                  f"({100 * (u.draft_n_accepted or 0) // u.draft_n}%)" if u.draft_n else "")
        sys.stderr.write(
            f"everycycle: prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), "
            f"generated {u.generated_tokens} ({u.finish_reason}); first token "
            f"{ttft:.0f} ms, {rate:.1f} tokens/s{drafts}\n")
