"""Building the C kernels at first use and loading them with ctypes (torch-free).

A kernel's source is compiled with the system C compiler (``$CC``, else ``cc`` or ``gcc``;
``-O3 -march=native -fopenmp``, or the ``-march`` of the ``PAGEWIRE_CPU_ISA`` level; exact math
apart from reassociation) into ``$PAGEWIRE_CACHE_DIR/kernels`` (default
``~/.cache/pagewire/kernels``), named by a hash of the source, the flags, the compiler, the CPU
and the ABI version, and written atomically so concurrent processes can race to build it. It links
the ``libgomp.so.1`` that torch has already loaded, so its threads are torch's OpenMP threads. No
compiler, or a failed build: :func:`load` returns None with one warning, and the caller keeps its
torch path.

Used by every kernel of this package (``csrc/*.c``), and by nothing outside it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess

from pagewire_common import cache_files, envs
from worker_svc.cpu import features

log = logging.getLogger("pagewire.worker")

# Reassociation lets the reductions vectorize. Not -ffast-math or -funsafe-math-optimizations: with
# either, gcc links crtfastmath.o, which would turn on flush-to-zero for the whole process at load.
_MATH = ["-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math", "-fassociative-math", "-freciprocal-math"]
_COMMON = ["-fopenmp", *_MATH, "-std=c11", "-shared", "-fPIC"]


def flag_sets() -> list[list[str]]:
    """The compiler flags to try, in order: tuned to this CPU (or to its ``PAGEWIRE_CPU_ISA``
    level), then without -march for a compiler or VM that refuses it."""
    return [["-O3", *features.march_flags(), *_COMMON], ["-O3", *_COMMON]]


def compiler() -> str | None:
    """The C compiler to use, or None when there is none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    cpu = features.cpu_info()
    return f"{cpu.model}\n{' '.join(sorted(cpu.flags))}"


def kernel_dir() -> pathlib.Path:
    return envs.cache_root() / "kernels"


def build(source: pathlib.Path, compiler: str, flags: list[str], out_dir: pathlib.Path, abi: int) -> pathlib.Path:
    """The shared library of ``source`` in ``out_dir``, compiled unless a build of the same
    source, flags, compiler, CPU and ``abi`` is already there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), " ".join(flags), version, _cpu_signature(), str(abi)]).encode()
    ).hexdigest()[:16]
    target = out_dir / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_files.remove_orphans(out_dir)  # what builds killed halfway left
    log.info("building %s with %s (once, into %s)", source.name, compiler, out_dir)
    tmp = str(cache_files.temp_path(out_dir, target.stem, ".so"))
    try:
        proc = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(proc.stderr.strip()[-2000:] or f"{compiler} exited with {proc.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: pathlib.Path, abi_symbol: str, abi: int, fallback: str) -> ctypes.CDLL | None:
    """``source`` built (once) and loaded; its ``int abi_symbol(void)`` must return ``abi``. None,
    after one warning that ends with ``fallback`` (what the caller does instead), when there is no
    compiler or no flag set builds it."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found (set CC, or install cc/gcc): %s", fallback)
        return None
    errors = []
    for flags in flag_sets():
        try:
            path = build(source, cc, flags, kernel_dir(), abi)
            lib = ctypes.CDLL(str(path))
            found = getattr(lib, abi_symbol)()
            if found != abi:
                raise RuntimeError(f"{path} has ABI {found}, expected {abi}")
            return lib
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
    log.warning("could not build %s; %s:\n%s", source.name, fallback, "\n".join(errors))
    return None
