"""One log format for every pagewire process (serve, worker, scheduler, API servers): each line
is ``time LEVEL logger: message`` on stderr, whichever process wrote it, so the interleaved output
of ``pagewire serve`` reads as one log. The logger names the process's role
(``pagewire.serve``, ``pagewire.worker``, ``pagewire.scheduler``, ``pagewire.api``)."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str = "info") -> None:
    """Send pagewire's (and every library's) log records to stderr in ``FORMAT``."""
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO), format=FORMAT, stream=sys.stderr,
                        force=True)
