"""One log format for every pagewire process (serve, worker, scheduler, API servers): each line
is ``time LEVEL logger: message`` on stderr, whichever process wrote it, so the interleaved output
of ``pagewire serve`` reads as one log. The logger names the process's role
(``pagewire.serve``, ``pagewire.worker``, ``pagewire.scheduler``, ``pagewire.api``)."""

from __future__ import annotations

import logging
import os
import sys
import time

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str = "info") -> None:
    """Send pagewire's (and every library's) log records to stderr in ``FORMAT``. Call it before
    gRPC is imported: gRPC's C core writes its own lines, in a format of its own and at INFO by
    default ("I1123 14:09:12.126679 21053 chttp2_transport.cc:1403] ... Got goaway" whenever a
    peer closes a connection), so it is kept to errors, unless ``--log-level debug`` or the user's
    own GRPC_VERBOSITY asks for more."""
    if str(level).lower() != "debug":
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # read by gRPC when it starts
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO), format=FORMAT, stream=sys.stderr,
                        force=True)


class WaitingNote:
    """Says, at info, that a process is still waiting for a peer it connects to (the worker, the
    scheduler core): once the wait has lasted ``first_s`` seconds, then every ``every_s``, with the
    last error. A peer that is merely starting (a model loading) stays quiet; one that is not there
    at all is named, instead of a process that says nothing."""

    def __init__(self, logger: logging.Logger, peer: str, first_s: float = 10.0, every_s: float = 60.0):
        self.logger, self.peer, self.first_s, self.every_s = logger, peer, first_s, every_s
        self._since: float | None = None
        self._next = 0.0

    def note(self, error: str) -> None:
        """One more failed attempt."""
        now = time.monotonic()
        if self._since is None:
            self._since, self._next = now, now + self.first_s
        elif now >= self._next:
            self._next = now + self.every_s
            self.logger.info("waiting for %s (%.0f s so far): %s", self.peer, now - self._since, error or "no answer")

    def reset(self) -> None:
        """Connected (or the wait starts over)."""
        self._since = None
