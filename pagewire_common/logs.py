"""One log format for every pagewire process (serve, worker, scheduler, API servers): each line
is ``time LEVEL logger: message`` on stderr, whichever process wrote it, so the interleaved output
of ``pagewire serve`` reads as one log. The logger names the process's role
(``pagewire.serve``, ``pagewire.worker``, ``pagewire.scheduler``, ``pagewire.api``)."""

from __future__ import annotations

import logging
import os
import sys

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
