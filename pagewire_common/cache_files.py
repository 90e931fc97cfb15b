"""Files pagewire builds under its cache root (converted models, compiled kernels) are written
under a temporary name that says which process writes them, then renamed into place: a build
killed halfway (SIGKILL, the OOM killer) leaves only such a name, and a later build in the same
folder removes those whose process is gone. Torch-free."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import uuid

log = logging.getLogger("pagewire.cache")

_TEMP_NAME = re.compile(r"\..+\.tmp-(\d+)-[0-9a-f]{8}(\.\w+)?")


def temp_path(folder: pathlib.Path, name: str, suffix: str = "") -> pathlib.Path:
    """Where this process builds ``name`` in ``folder`` before renaming it into place."""
    return folder / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}"


def remove_orphans(folder: pathlib.Path) -> None:
    """Remove the temporary files and folders (``temp_path``) in ``folder`` whose process is gone."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for path in entries:
        match = _TEMP_NAME.fullmatch(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log.info("removed %s, left by a build that was killed", path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True
