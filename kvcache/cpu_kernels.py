"""The CPU paged-attention kernel (csrc/cpu_paged_attention.c): built once, loaded with ctypes.

On CPU the torch reference gathers every sequence's blocks into padded tensors and then runs
SDPA: the context is copied, padded to the longest sequence, and read again. The C kernel reads
K/V in place through the block table, so a step's attention costs one pass over the context it
really has. That matters most in mixed steps, where decodes with long contexts ride alongside a
prefill chunk.

The shared library is compiled at first use with the system C compiler (``$CC``, else ``cc`` or
``gcc``; ``-O3 -march=native -fopenmp``, exact math apart from reassociation) into ``$PAGEWIRE_CACHE_DIR/kernels`` (default
``~/.cache/pagewire/kernels``), named by a hash of the source, the flags, the compiler and the
CPU, and written atomically so concurrent processes can race to build it. It links the
``libgomp.so.1`` that torch has already loaded, so its threads are torch's OpenMP threads. No
compiler, or a failed build: :func:`kernels` returns None with one warning, and attention stays
on the torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch

from pagewire_common import envs

log = logging.getLogger("pagewire.worker")

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "cpu_paged_attention.c"
_ABI = 2
# Reassociation lets the reductions vectorize. Not -ffast-math or -funsafe-math-optimizations: with
# either, gcc links crtfastmath.o, which would turn on flush-to-zero for the whole process at load.
_MATH = ["-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math", "-fassociative-math", "-freciprocal-math"]
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", *_MATH, "-std=c11", "-shared", "-fPIC"],
    ["-O3", "-fopenmp", *_MATH, "-std=c11", "-shared", "-fPIC"],  # a compiler or VM without -march=native
)
_ERRORS = {
    -1: "num_heads is not a multiple of num_kv_heads",
    -2: "query_start_loc does not span the query tokens",
    -3: "a sequence has more query tokens than context",
    -4: "a sequence's context needs more blocks than its block table row holds",
    -5: "a block table entry is outside the cache",
    -6: "out of memory for scratch buffers",
}


class CpuKernels:
    """The loaded library, with a torch-facing call."""

    def __init__(self, lib: ctypes.CDLL, path: pathlib.Path):
        self.path = path
        self._fns = {torch.float32: lib.paged_attention_f32, torch.bfloat16: lib.paged_attention_bf16}
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64]

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, H, D]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        query_start_loc: torch.Tensor,  # [S + 1] int32
        seq_lens: torch.Tensor,  # [S] int32
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        scale: float,
        max_query_len: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for every query token, or, given ``max_query_len``, only for sequences with at
        most that many query tokens: the rows of longer chunks in ``out`` are left as they are
        (for the caller to fill)."""
        num_tokens, num_heads, head_dim = query.shape
        _, num_blocks, block_size, num_kv_heads, kv_dim = kv_layer.shape
        if kv_dim != head_dim:
            raise ValueError(f"query head_dim {head_dim} != cache head_dim {kv_dim}")
        if query.device.type != "cpu" or not self.supports(query.dtype) or kv_layer.dtype != query.dtype:
            raise ValueError(f"the CPU kernel takes float32 or bfloat16 CPU tensors, got {query.dtype}/{kv_layer.dtype}")
        num_seqs = seq_lens.shape[0]
        if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
            raise ValueError("query_start_loc, seq_lens and block_tables disagree on the number of sequences")
        query = query.contiguous()
        kv_layer = kv_layer.contiguous()
        query_start_loc = query_start_loc.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        block_tables = block_tables.to(torch.int32).contiguous()
        if out is None:
            out = torch.empty_like(query)
        elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor shaped and typed like query")
        rc = self._fns[query.dtype](
            query.data_ptr(), kv_layer.data_ptr(), out.data_ptr(),
            query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale,
            num_tokens if max_query_len is None else max_query_len,
        )  # fmt: skip
        if rc:
            raise ValueError(f"CPU paged attention: {_ERRORS.get(rc, f'error {rc}')}")
        return out


def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _kernel_dir() -> pathlib.Path:
    return envs.cache_root() / "kernels"


def _build(compiler: str, flags: list[str], out_dir: pathlib.Path) -> pathlib.Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), " ".join(flags), version, _cpu_signature(), str(_ABI)]).encode()
    ).hexdigest()[:16]
    target = out_dir / f"cpu_paged_attention-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("building the CPU attention kernel with %s (once, into %s)", compiler, out_dir)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(proc.stderr.strip()[-2000:] or f"{compiler} exited with {proc.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def kernels() -> CpuKernels | None:
    """The CPU kernels, built on first call; None (after one warning) when they cannot be built."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found (set CC, or install cc/gcc): CPU attention uses the slower torch reference")
        return None
    errors = []
    for flags in _FLAG_SETS:
        try:
            path = _build(compiler, flags, _kernel_dir())
            lib = ctypes.CDLL(str(path))
            if lib.pagewire_cpu_kernels_abi() != _ABI:
                raise RuntimeError(f"{path} has ABI {lib.pagewire_cpu_kernels_abi()}, expected {_ABI}")
            return CpuKernels(lib, path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
    log.warning("could not build the CPU attention kernel; using the torch reference:\n%s", "\n".join(errors))
    return None
