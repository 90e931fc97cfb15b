"""llama.cpp's ``llama-server`` as a baseline: found or built from source, fed GGUF copies of the
model pagewire serves, and started with a command line for a given workload.

- **The binary.** A given path is used as is. Otherwise the source distribution of
  ``llama-cpp-python`` (``LLAMA_CPP_PYTHON_VERSION``) is downloaded with pip, its vendored
  ``vendor/llama.cpp`` extracted, and only the ``llama-server`` target built with cmake: CPU only,
  ``-march=native`` (``GGML_NATIVE``; under ``PAGEWIRE_CPU_ISA``, the instruction sets of that
  level named one by one), Release, static, no OpenSSL, no web UI (so nothing is fetched during
  the build). The binary is cached under ``<pagewire cache>/llama.cpp/`` by a key of
  the version, the CPU's flags and the cmake options, so it is rebuilt only when one of them changes.
- **The weights.** pagewire's converted safetensors directory is written as GGUF (f32, f16, bf16
  or q8_0) by llama.cpp's own ``convert_hf_to_gguf.py`` from the same source, once per type: both
  servers then run the same weights. The converter runs in this Python and needs torch,
  transformers, numpy, pyyaml and sentencepiece. ``q4_1`` is the embedded GGUF itself
  (``SmolLM2-135M-Instruct.Q4_1.gguf``, the file pagewire dequantizes), served as it is; the
  converter writes no 4-bit type.
- **The servers.** A configuration is ``ENGINE:TYPE`` and, after a space, more flags for that
  server: ``llama:q4_1 --no-repack`` passes ``--no-repack`` to llama-server, ``pagewire:auto
  --no-prefix-cache`` (or any flag of ``pagewire serve``'s worker, core, API-server and process
  settings, such as a weight format) to ``pagewire serve``, checked by pagewire's own parser
  before anything runs.

Everything here is plain Python (subprocess, tarfile, hashlib), torch-free; the converter
imports torch in its own process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagewire_common import envs
from pagewire_common.settings import API, CORE, PROCESS, WORKER, Settings, add_arguments
from worker_svc.cpu import features

# llama-cpp-python's sdist vendors a llama.cpp revision with llama-server and convert_hf_to_gguf.py
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_SOURCE_SUBDIR = "vendor/llama.cpp"
SERVER_TARGET = "llama-server"
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # what the converter writes
EMBEDDED_GGUF_TYPE = "q4_1"  # the embedded GGUF as it ships (the file pagewire's default model comes from)
LLAMA_TYPES = (*GGUF_TYPES, EMBEDDED_GGUF_TYPE)
ENGINES = ("llama", "pagewire")
DEFAULT_CONFIGS = "llama:q4_1,pagewire:auto,llama:q8_0,llama:bf16"
# flags the bench sets itself on each server
BENCH_FLAGS = {"llama": ("--model", "-m", "--host", "--port", "--parallel", "-np", "--ctx-size", "-c"),
               "pagewire": ("--dtype", "--http-listen", "--listen")}
# CPU only, tuned to this CPU, one static binary; no OpenSSL (plain HTTP on loopback is all a bench
# needs) and no web UI (the prebuilt one would be downloaded during the build)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_CCACHE=OFF",
)
# llama.cpp pads each slot's share of the context to a multiple of this many tokens
SLOT_CTX_ALIGN = 256
# Python modules the converter imports, and the pip package that gives each
CONVERTER_MODULES = {"torch": "torch", "transformers": "transformers", "numpy": "numpy", "yaml": "pyyaml",
                     "sentencepiece": "sentencepiece", "tqdm": "tqdm", "requests": "requests"}


class LlamaCppError(RuntimeError):
    """Something the user can fix: a missing tool or package, a failed download, build or conversion."""


# ---- which servers to run ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One server to measure: ``llama`` with a GGUF type, or ``pagewire`` with a ``--dtype``, and
    more flags for that server (``args``: llama-server's as given, pagewire's as
    ``Settings.to_argv`` writes them back)."""

    engine: str
    dtype: str
    args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.engine}:{self.dtype}" + (f" {shlex.join(self.args)}" if self.args else "")

    def with_args(self, *more: str) -> "ServerConfig":
        return ServerConfig(self.engine, self.dtype, (*self.args, *more))


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def pagewire_serve_argv(args: tuple[str, ...] | list[str], **settings) -> list[str]:
    """``pagewire serve``'s flags for the worker, core, API-server and process settings in ``args``
    together with ``settings`` (keyword settings), as ``Settings.to_argv`` writes them; ValueError
    with pagewire's own message for a flag it does not take or a value it refuses."""
    parser = _RaisingParser(prog="pagewire serve", add_help=False)
    add_arguments(parser, (WORKER, CORE, API, PROCESS), unset_defaults=True)
    namespace, unknown = parser.parse_known_args(list(args))
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)}")
    given = {name: value for name, value in vars(namespace).items() if value is not None}
    return Settings(**given, **settings).to_argv((WORKER, CORE, API, PROCESS))


def parse_configs(text: str) -> list[ServerConfig]:
    """``llama:q4_1,pagewire:auto,llama:q8_0 --no-repack,...`` in the order given: ``ENGINE:TYPE``,
    then, after a space, flags for that server (shell-quoted). A pagewire dtype and its flags are
    checked by pagewire's own settings, so one it does not take is refused here with its message,
    before anything runs."""
    configs: list[ServerConfig] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        head, _, rest = item.partition(" ")
        engine, sep, dtype = head.partition(":")
        if not sep or engine not in ENGINES or not dtype:
            raise ValueError(f"{item!r}: expected ENGINE:TYPE [FLAGS] with ENGINE one of {', '.join(ENGINES)} "
                             f"(e.g. llama:q8_0, pagewire:bfloat16, llama:q4_1 --no-repack)")
        try:
            args = tuple(shlex.split(rest))
        except ValueError as e:
            raise ValueError(f"{item!r}: {e}") from None
        taken = [a for a in args if a.split("=", 1)[0] in BENCH_FLAGS[engine]]
        if taken:
            raise ValueError(f"{item!r}: {', '.join(taken)} is set by the bench")
        if engine == "llama" and dtype not in LLAMA_TYPES:
            raise ValueError(f"{item!r}: llama takes a GGUF type, one of {', '.join(LLAMA_TYPES)}")
        if engine == "pagewire":
            try:
                pagewire_serve_argv(args, dtype=dtype)  # the dtype and the flags together
                args = tuple(pagewire_serve_argv(args))
            except ValueError as e:
                raise ValueError(f"{item!r}: pagewire refuses it: {e}") from None
        config = ServerConfig(engine, dtype, args)
        if config in configs:
            raise ValueError(f"{item!r} is given twice")
        configs.append(config)
    if not configs:
        raise ValueError("no configuration given")
    return configs


# ---- what to measure ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scenario:
    """A workload: ``num_requests`` streamed requests, ``concurrency`` of them in flight (and as
    many llama-server slots), ``max_new_tokens`` greedy tokens each, EOS ignored."""

    name: str
    concurrency: int
    num_requests: int
    max_new_tokens: int


# one user: one client asking one thing after another; many users: 32 streams at once
SCENARIOS = {"one-stream": Scenario("one-stream", 1, 8, 128), "32-streams": Scenario("32-streams", 32, 64, 64)}
DEFAULT_SCENARIOS = "one-stream,32-streams"


def parse_scenarios(text: str) -> list[Scenario]:
    """``one-stream,32-streams`` (the named ones) or ``CxRxT`` (C streams, R requests, T new
    tokens each, e.g. ``4x16x64``), in the order given."""
    scenarios: list[Scenario] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        scenario = SCENARIOS.get(item)
        if scenario is None:
            parts = item.split("x")
            if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"{item!r}: expected one of {', '.join(SCENARIOS)} or STREAMSxREQUESTSxTOKENS "
                                 f"with positive numbers (e.g. 4x16x64)")
            scenario = Scenario(item, *(int(p) for p in parts))
        if scenario in scenarios:
            raise ValueError(f"{item!r} is given twice")
        scenarios.append(scenario)
    if not scenarios:
        raise ValueError("no scenario given")
    return scenarios


def decode_tokens_per_s(records) -> float | None:
    """The decode rate after the first token: over every request, the tokens after its first
    divided by the time from its first token's arrival to its last's (a lone stream's rate,
    its prompt left out); None when no request had two token arrivals."""
    tokens, seconds = 0, 0.0
    for rec in records:
        arrivals = [(t, k) for t, k in zip(rec.arrival_times, rec.arrival_counts) if k > 0]
        n = sum(k for _, k in arrivals)
        if n >= 2 and arrivals[-1][0] > arrivals[0][0]:
            tokens += n - arrivals[0][1]
            seconds += arrivals[-1][0] - arrivals[0][0]
    return tokens / seconds if seconds > 0 else None


# ---- llama-server's command line --------------------------------------------------------------


def server_command(binary: Path, gguf: Path, *, host: str, port: int, threads: int, parallel: int,
                   ctx_per_slot: int) -> list[str]:
    """llama-server for ``parallel`` concurrent streams: that many slots, continuous batching over
    them, each slot with at least ``ctx_per_slot`` tokens of context (``--ctx-size`` is the total,
    split among the slots, each share padded by llama.cpp to a multiple of ``SLOT_CTX_ALIGN``),
    ``threads`` threads for decoding and for prompts."""
    slot = -(-ctx_per_slot // SLOT_CTX_ALIGN) * SLOT_CTX_ALIGN
    return [
        str(binary), "--model", str(gguf), "--host", host, "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(parallel), "--cont-batching", "--ctx-size", str(parallel * slot),
        "--no-webui",
    ]


# ---- the cache --------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``<pagewire's cache root>/llama.cpp`` ($PAGEWIRE_CACHE_DIR, else ~/.cache/pagewire)."""
    return envs.cache_root() / "llama.cpp"


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's feature flags, sorted (x86 ``flags`` or Arm ``Features`` of ``cpuinfo``, the text
    of /proc/cpuinfo; this machine's own when None)."""
    cpu = features.host_cpu_info() if cpuinfo is None else features.parse_cpuinfo(cpuinfo)
    return sorted(cpu.flags)


# llama.cpp's options for each x86 instruction set, and the CPU flag that turns each on
_GGML_ISA_OPTIONS = (("AVX", "avx"), ("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"), ("BMI2", "bmi2"),
                     ("AVX_VNNI", "avx_vnni"), ("AVX512", "avx512f"), ("AVX512_VBMI", "avx512vbmi"),
                     ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"), ("AMX_TILE", "amx_tile"),
                     ("AMX_INT8", "amx_int8"), ("AMX_BF16", "amx_bf16"))


def cmake_options(cpu: features.CpuInfo | None = None) -> tuple[str, ...]:
    """``CMAKE_OPTIONS`` for this CPU (``features.cpu_info()``): ``-march=native``, or where
    ``PAGEWIRE_CPU_ISA`` caps it, each instruction set named on or off as the capped CPU has it, so
    that llama-server runs at the same level as pagewire."""
    cpu = cpu or features.cpu_info()
    if cpu.capped_from is None:
        return CMAKE_OPTIONS
    named = tuple(f"-DGGML_{option}={'ON' if flag in cpu.flags else 'OFF'}" for option, flag in _GGML_ISA_OPTIONS)
    return tuple(o if o != "-DGGML_NATIVE=ON" else "-DGGML_NATIVE=OFF" for o in CMAKE_OPTIONS) + named


def build_key(version: str, flags: list[str], cmake_options: tuple[str, ...] = CMAKE_OPTIONS) -> str:
    """The cache key of a built binary: a native build is only valid on a CPU with the same flags."""
    digest = hashlib.sha256(json.dumps([version, sorted(flags), list(cmake_options)]).encode()).hexdigest()
    return f"{version}-{digest[:12]}"


def binary_path(root: Path, version: str, flags: list[str], options: tuple[str, ...] = CMAKE_OPTIONS) -> Path:
    return root / f"{SERVER_TARGET}-{build_key(version, flags, options)}" / SERVER_TARGET


def gguf_path(root: Path, version: str, model_dir: Path, outtype: str) -> Path:
    """Where the GGUF of ``model_dir`` (a converted copy whose name already holds a content hash)
    in ``outtype``, written by the converter of ``version``, is cached."""
    return root / "gguf" / f"{model_dir.name}-llama.cpp{version}-{outtype}.gguf"


# ---- commands ---------------------------------------------------------------------------------


def download_command(version: str, dest: Path) -> list[str]:
    """pip fetches the source distribution only (pip prepares its metadata, which needs its build
    backend's wheels, not a build)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
            f"llama-cpp-python=={version}", "--dest", str(dest)]


def configure_command(source: Path, build: Path, options: tuple[str, ...] = CMAKE_OPTIONS) -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(build), *options]


def build_command(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", SERVER_TARGET, "--config", "Release", "-j", str(jobs)]


def convert_command(source: Path, model_dir: Path, outtype: str, outfile: Path) -> list[str]:
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type must be one of {', '.join(GGUF_TYPES)}, got {outtype!r}")
    return [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
            "--outfile", str(outfile)]


# ---- doing it ---------------------------------------------------------------------------------

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(argv: list[str], what: str, log: Log, *, cwd: Path | None = None, progress: re.Pattern | None = None) -> str:
    """Run ``argv``, passing on the lines that match ``progress`` (every line when None); raise
    LlamaCppError with the output's tail when it fails. Returns the tail."""
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            if progress is None or progress.search(line):
                log(f"  {line}")
    out = "\n".join(tail)
    if proc.returncode != 0:
        raise LlamaCppError(f"{what} failed (exit code {proc.returncode}):\n$ {' '.join(argv)}\n{out}")
    return out


def check_build_tools() -> None:
    """cmake and a C/C++ compiler are on PATH, or say what to install."""
    missing = [name for name, found in (("cmake", shutil.which("cmake")),
                                        ("a C++ compiler (g++ or clang++)",
                                         shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")),
                                        ("a C compiler (gcc or clang)",
                                         shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")))
               if not found]
    if missing:
        raise LlamaCppError(
            f"building llama-server needs {' and '.join(missing)}: install them (Debian/Ubuntu: "
            f"apt-get install cmake g++; or pip install cmake), or pass --llama-server PATH to a built binary")


def fetch_source(root: Path, version: str = LLAMA_CPP_PYTHON_VERSION, log: Log = _stderr) -> Path:
    """llama.cpp's source as vendored by llama-cpp-python ``version``: downloaded and extracted
    once into ``root``."""
    source = root / f"llama-cpp-python-{version}" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    sdist = downloads / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        log(f"downloading the source of llama-cpp-python {version} (llama.cpp vendored, ~80 MB) with pip...")
        _run(download_command(version, downloads), "pip download of llama-cpp-python", log,
             progress=re.compile(r"Downloading|Saved|ERROR|error"))
        if not sdist.is_file():
            raise LlamaCppError(f"pip did not save {sdist.name} in {downloads}")
    log(f"extracting {LLAMA_SOURCE_SUBDIR} from {sdist.name}...")
    prefix = f"llama_cpp_python-{version}/{LLAMA_SOURCE_SUBDIR}/"
    tmp = root / f".extract-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise LlamaCppError(f"{sdist.name} has no {LLAMA_SOURCE_SUBDIR}")
            tar.extractall(tmp, members=members, filter="data")
        source.parent.mkdir(parents=True, exist_ok=True)
        if source.exists():  # a leftover without CMakeLists.txt
            shutil.rmtree(source)
        os.replace(tmp / prefix.rstrip("/"), source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return source


_BUILD_PROGRESS = re.compile(r"^\[\s*\d+%\]|^\[\d+/\d+\]|error|Error")


def find_or_build_server(root: Path, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None,
                         log: Log = _stderr) -> Path:
    """The cached llama-server for this CPU (or its ``PAGEWIRE_CPU_ISA`` level), built first if
    there is none (minutes)."""
    options = cmake_options()
    binary = binary_path(root, version, cpu_flags(), options)
    if binary.is_file():
        return binary
    check_build_tools()
    source = fetch_source(root, version, log)
    jobs = jobs or len(os.sched_getaffinity(0))
    build = root / f".build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        isa = "-march=native" if options == CMAKE_OPTIONS else f"the instruction sets of {features.cpu_info().isa}"
        log(f"configuring llama.cpp (cmake, CPU only, {isa}) in {build}...")
        _run(configure_command(source, build, options), "cmake configure", log, progress=re.compile(r"CMake Error|-- x86|ARM"))
        log(f"building {SERVER_TARGET} with {jobs} jobs (several minutes)...")
        _run(build_command(build, jobs), f"building {SERVER_TARGET}", log, progress=_BUILD_PROGRESS)
        built = next((p for p in (build / "bin" / SERVER_TARGET, build / "bin" / "Release" / SERVER_TARGET)
                      if p.is_file()), None)
        if built is None:
            raise LlamaCppError(f"the build finished without {SERVER_TARGET} under {build / 'bin'}")
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_name(f".{SERVER_TARGET}.tmp-{os.getpid()}")
        shutil.copy2(built, tmp)
        os.replace(tmp, binary)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    log(f"built {binary}")
    return binary


def check_converter_modules() -> None:
    """The converter's imports are installed in this Python, or say which to pip install."""
    import importlib.util

    missing = sorted({pkg for module, pkg in CONVERTER_MODULES.items() if importlib.util.find_spec(module) is None})
    if missing:
        raise LlamaCppError(f"llama.cpp's convert_hf_to_gguf.py needs {', '.join(missing)} in this Python: "
                            f"{sys.executable} -m pip install {' '.join(missing)}")


def convert_to_gguf(root: Path, model_dir: Path, outtype: str, version: str = LLAMA_CPP_PYTHON_VERSION,
                    log: Log = _stderr) -> Path:
    """``model_dir`` as a GGUF of ``outtype``, written once by llama.cpp's converter."""
    target = gguf_path(root, version, model_dir, outtype)
    if target.is_file():
        return target
    check_converter_modules()
    source = fetch_source(root, version, log)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    log(f"converting {model_dir.name} to GGUF {outtype} with llama.cpp's convert_hf_to_gguf.py...")
    try:
        out = _run(convert_command(source, model_dir, outtype, tmp), f"convert_hf_to_gguf.py --outtype {outtype}",
                   log, cwd=source, progress=re.compile(r"Error|error"))
        if not tmp.is_file():
            raise LlamaCppError(f"convert_hf_to_gguf.py wrote no {tmp}:\n{out}")
        os.replace(tmp, target)
    except LlamaCppError as e:
        m = re.search(r"No module named '([\w.]+)'", str(e))
        if m:
            raise LlamaCppError(f"llama.cpp's converter needs the Python module {m.group(1)!r}: "
                                f"{sys.executable} -m pip install {m.group(1).split('.')[0]}") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return target
