"""A Llama-family model built straight from a GGUF file, its Q4_0, Q4_1 and Q8_0 tensors kept in
their blocks (``worker_svc.cpu.quantized``) on CPU.

The file's header is read by :class:`GGUFFile` (its tensors mapped from the file) and mapped to our modules by
name: ``blk.N.attn_q/attn_k/attn_v`` -> ``qkv_proj``, ``attn_output`` -> ``o_proj``,
``ffn_gate/ffn_up`` -> ``gate_up_proj``, ``ffn_down`` -> ``down_proj``, ``token_embd`` -> the
embedding (and the tied head), ``output`` -> the head, norms by name. llama.cpp's converter
permutes the rows of q and k within each head for its rotary layout (``convert_hf_to_gguf.py``
``LlamaModel.permute``, GGUF architecture ``llama``); the rows are put back in Hugging Face order
here, as transformers' GGUF loader does, whole rows of blocks at a time. F32, F16 and BF16 tensors
load as plain parameters. The model directory (``weights.resolve_model_path``'s conversion of the
same file) gives the config.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from worker_svc.config import ModelConfig
from worker_svc.cpu.quantized import (
    QuantEmbedding,
    QuantLinear,
    QuantPart,
    block_type,
    pack_blocks,
)
from worker_svc.layers import RotaryEmbedding
from worker_svc.models import _SkipInit, get_model_class

log = logging.getLogger("pagewire.worker")

# GGUF architectures served from their blocks, and whether q and k rows were permuted for rotary
ARCHITECTURES = {"llama": True, "qwen2": False}
# blk.N.<name> -> (our module under model.layers.N, its shard)
_LINEARS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_DENSE_TYPES = ("F32", "F16", "BF16")


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q or k weight's rows ([N, ...], N = heads x head_dim)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class GGUFFile:
    """The header of a GGUF file (v2, v3, little-endian): its metadata values and, per tensor, its
    ggml type, shape (ggml order: inputs first) and bytes, mapped from the file without a copy.

    gguf.GGUFReader reads the same, but builds a numpy view per element of every metadata array
    (the vocabulary and merges: seconds per start); this reads past them."""

    _SCALARS: ClassVar[dict[int, str]] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, path: str | os.PathLike):
        """``ValueError`` for a file that is not GGUF, or whose header or tensors are cut short."""
        import struct

        if os.path.getsize(path) < 24:
            raise ValueError(f"{path} is not a readable GGUF file: {os.path.getsize(path)} bytes, shorter than a header")
        try:
            self._read(path)
        except (struct.error, IndexError, KeyError, OverflowError, MemoryError) as e:
            raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e!r}") from None

    def _read(self, path: str | os.PathLike) -> None:
        import struct

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = str(path)
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(data)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, num_tensors, num_values = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read (2 and 3 are)")
        pos = 24

        def string() -> str:
            nonlocal pos
            (length,) = struct.unpack_from("<Q", buf, pos)
            text = bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8", errors="replace")
            pos += 8 + length
            return text

        def value(kind: int, keep: bool):
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:
                (item_kind, count), pos = struct.unpack_from("<IQ", buf, pos), pos + 12
                if item_kind in self._SCALARS:  # a numeric array: skipped whole
                    size = struct.calcsize(self._SCALARS[item_kind])
                    pos += size * count
                    return None
                items = [value(item_kind, keep) for _ in range(count)]
                return items if keep else None
            fmt = self._SCALARS[kind]
            (result,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return result

        self.values: dict[str, object] = {}
        for _ in range(num_values):
            key = string()
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            self.values[key] = value(kind, keep=not key.startswith("tokenizer."))
        infos = []
        for _ in range(num_tensors):
            name = string()
            (num_dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
            pos += 4 + 8 * num_dims + 12
            infos.append((name, tuple(int(d) for d in shape), kind, offset))
        alignment = int(self.values.get("general.alignment", 32))
        start = -(-pos // alignment) * alignment
        self.types: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._bytes: dict[str, np.ndarray] = {}
        for name, shape, kind, offset in infos:
            try:
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise ValueError(f"GGUF tensor {name} has ggml type {kind}, unknown to the gguf package") from None
            nbytes = int(np.prod(shape)) // block * type_bytes
            if start + offset + nbytes > len(data):
                raise ValueError(f"{path} is truncated: tensor {name} ends past the end of the file")
            self.types[name], self.shapes[name] = kind, shape
            self._bytes[name] = data[start + offset : start + offset + nbytes]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [rows, bytes per row] (rows: its last ggml dimension)."""
        shape = self.shapes[name]
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        return self._bytes[name].reshape(rows, -1)

    def type_name(self, name: str) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.types[name]).name


class GGUFTensors:
    """The tensors of one GGUF file by name: their ggml type, and rows in Hugging Face order."""

    def __init__(self, path: str | os.PathLike, config: ModelConfig):
        self.file = GGUFFile(path)
        self.architecture = self.file.values.get("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.architecture!r} is not served from its blocks "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        self.permuted = ARCHITECTURES[self.architecture]
        self.config = config
        self.tensors = self.file.types  # name -> ggml type id

    def type_name(self, name: str) -> str:
        return self.file.type_name(name)

    def is_dense(self, name: str) -> bool:
        return self.type_name(name) in _DENSE_TYPES

    def _rows(self, name: str) -> np.ndarray:
        """The tensor's bytes, one row per output (uint8 [N, bytes per row]), in Hugging Face order."""
        data = self.file.raw(name)
        heads = self._permuted_heads(name)
        if not heads:
            return data
        if len(self.file.shapes[name]) == 1:  # a q or k bias: its elements are permuted as the rows are
            data = data.reshape(self.file.shapes[name][0], -1)
        return _unpermute_rows(data, heads)

    def _permuted_heads(self, name: str) -> int | None:
        if not self.permuted:
            return None
        if ".attn_q." in name:
            return self.config.num_heads
        if ".attn_k." in name:
            return self.config.num_kv_heads
        return None

    def dense(self, name: str) -> torch.Tensor:
        """An F32, F16 or BF16 tensor in Hugging Face layout ([out, in] for a weight)."""
        kind = self.type_name(name)
        rows = np.array(self._rows(name), copy=True)  # [N, bytes per row]
        shape = tuple(reversed(self.file.shapes[name]))
        if kind == "BF16":
            return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(rows.view(np.float32 if kind == "F32" else np.float16)).reshape(shape)

    def part(self, name: str) -> tuple[QuantPart, int]:
        """A quantized weight as a packed :class:`QuantPart`, with its input size."""
        btype = block_type(self.tensors[name], f"GGUF tensor {name}")
        k, n = self.file.shapes[name][:2]
        with warnings.catch_warnings():  # a read-only view of the file's map: only read, by the packing
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(np.ascontiguousarray(self._rows(name)))
        return QuantPart(btype, pack_blocks(blocks, btype, n, k), n), k


def load_gguf_model(gguf_path: str | os.PathLike, config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """Our model for ``config`` on CPU with the GGUF file's quantized linears, embedding and head
    kept in their blocks (:class:`QuantLinear`, :class:`QuantEmbedding`) and its other tensors
    loaded as parameters in ``dtype``. ValueError for a tensor of a block type that is not served
    (naming it and what is supported) or an architecture other than ``ARCHITECTURES``."""
    if config.architecture != "llama":
        raise ValueError(f"architecture {config.architecture!r} is not served from GGUF blocks (Llama family only)")
    tensors = GGUFTensors(gguf_path, config)
    for name in tensors.tensors:  # every quantized tensor of a known module must be a served type
        if not tensors.is_dense(name) and not name.endswith("rope_freqs.weight"):
            block_type(tensors.tensors[name], f"GGUF tensor {name}")

    with torch.device("meta"), _SkipInit():
        model = get_model_class(config)(config)
    model.to(dtype=dtype)
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
    model.requires_grad_(False)

    dense: list[tuple[str, torch.Tensor]] = []
    layer_pattern = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
    fused: dict[str, dict[int, str]] = {}  # our module -> shard -> GGUF weight name
    for name in tensors.tensors:
        match = layer_pattern.match(name)
        if match is None:
            continue
        layer, kind, param = match.groups()
        prefix = f"model.layers.{layer}"
        if kind in _NORMS:
            dense.append((f"{prefix}.{_NORMS[kind]}.{param}", tensors.dense(name)))
        elif kind in _LINEARS and param == "weight":
            module, shard = _LINEARS[kind]
            fused.setdefault(f"{prefix}.{module}", {})[shard] = name
    for module_name, shards in fused.items():
        names = [shards[s] for s in sorted(shards)]
        linear = model.get_submodule(module_name)
        if any(tensors.is_dense(n) for n in names):  # kept dense: loaded by name below
            dense += [(_hf_name(n), tensors.dense(n)) for n in names]
            continue
        parts = [tensors.part(n)[0] for n in names]
        bias = _bias(tensors, names)
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantLinear(parts, linear.in_features, bias))
    for name in tensors.tensors:  # biases of quantized linears are in the QuantLinear; others load dense
        match = layer_pattern.match(name)
        if match and match.group(3) == "bias" and match.group(2) in _LINEARS:
            module_name = f"model.layers.{match.group(1)}.{_LINEARS[match.group(2)][0]}"
            if not isinstance(model.get_submodule(module_name), QuantLinear):
                dense.append((_hf_name(name), tensors.dense(name)))

    dense.append(("model.norm.weight", tensors.dense("output_norm.weight")))
    head = None
    if "output.weight" in tensors.tensors and not config.tie_word_embeddings:
        if tensors.is_dense("output.weight"):
            dense.append(("lm_head.weight", tensors.dense("output.weight")))
        else:
            part, k = tensors.part("output.weight")
            head = model.packed_lm_head = QuantLinear([part], k)
            model.lm_head = None  # its weight lives in the packed head only
    if tensors.is_dense("token_embd.weight"):
        dense.append(("model.embed_tokens.weight", tensors.dense("token_embd.weight")))
    else:
        part, k = tensors.part("token_embd.weight")
        table = QuantLinear([part], k)
        model.model.embed_tokens = QuantEmbedding(table)
        if head is None and model.lm_head is None:
            model.packed_lm_head = table  # tied: the table is the head, one copy
    model.load_weights(dense)
    return model.eval()


def _hf_name(gguf_name: str) -> str:
    layer, kind, param = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", gguf_name).groups()
    module = _LINEARS[kind][0]
    hf_leaf = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj"}.get(kind)
    if hf_leaf is None:
        hf_leaf = {"attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}[kind]
    return f"model.layers.{layer}.{module.split('.')[0]}.{hf_leaf}.{param}"


def _bias(tensors: GGUFTensors, weight_names: list[str]) -> torch.Tensor | None:
    biases = [n.removesuffix(".weight") + ".bias" for n in weight_names]
    if not any(b in tensors.tensors for b in biases):
        return None
    return torch.cat([tensors.dense(b).float() for b in biases])
