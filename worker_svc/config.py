"""The model configuration the worker runs on, parsed once from a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("gpt2", "llama", "qwen3")
# Hugging Face model_type -> our architecture. Mistral and Qwen2 are Llama-shaped (RMSNorm, RoPE,
# gated SiLU MLP); they differ only in which projections carry a bias. Qwen3 adds an RMSNorm per
# head on queries and keys, and states its head_dim.
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "qwen3"}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Defaults of each family's transformers config class, for keys a config.json may leave out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}


@dataclass(frozen=True)
class ModelConfig:
    """What our model code needs to know about a checkpoint; validated once, passed whole."""

    architecture: str  # "gpt2" | "llama" | "qwen3"
    model_type: str  # the raw Hugging Face model_type
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int
    norm_eps: float
    rope_theta: float
    # None for plain RoPE; otherwise the scaling parameters including "rope_type" (only "llama3").
    rope_scaling: dict[str, Any] | None = field(hash=False)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # the dtype the checkpoint was saved in (config.json's "torch_dtype", "dtype" in newer files);
    # None when it does not say. ``--dtype auto`` follows it on CUDA (worker_svc.dtypes).
    checkpoint_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_model_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.architecture == "gpt2" and self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"gpt2: num_heads * head_dim ({self.num_heads} * {self.head_dim}) != hidden_size ({self.hidden_size})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported activation {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type != "llama3":
                raise ValueError(
                    f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            missing = [k for k in _LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
        # Ids are only checked for sign: an id past the vocabulary can never be sampled, which is harmless.
        if self.bos_token_id is not None and self.bos_token_id < 0:
            raise ValueError(f"bos_token_id must be non-negative, got {self.bos_token_id}")
        if any(eos < 0 for eos in self.eos_token_ids):
            raise ValueError(f"eos token ids must be non-negative, got {self.eos_token_ids}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Map a Hugging Face config dict (config.json contents) to a ModelConfig."""
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        eos = cfg.get("eos_token_id")
        eos_token_ids = _token_ids(eos)
        if model_type == "gpt2":
            config = cls._from_gpt2(cfg, eos_token_ids)
        else:
            config = cls._from_llama_family(cfg, model_type, eos_token_ids)
        saved = cfg.get("torch_dtype") or cfg.get("dtype")
        return dataclasses.replace(config, checkpoint_dtype=saved if isinstance(saved, str) else None)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        """Read ``config.json`` in directory ``path``; end-of-sequence ids from ``generation_config.json``
        (when present) are added to those of the config, as generation uses both."""
        directory = pathlib.Path(path)
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {directory}")
        cfg = _read_json(config_file)
        generation_file = directory / "generation_config.json"
        if generation_file.is_file():
            extra = _token_ids(_read_json(generation_file).get("eos_token_id"))
            merged = _token_ids(cfg.get("eos_token_id")) + extra
            cfg = {**cfg, "eos_token_id": list(dict.fromkeys(merged))}
        return cls.from_hf_config(cfg)

    @classmethod
    def _from_gpt2(cls, cfg: dict[str, Any], eos_token_ids: tuple[int, ...]) -> ModelConfig:
        if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
            raise ValueError("gpt2: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        if cfg.get("scale_attn_weights", True) is False:
            raise ValueError("gpt2: scale_attn_weights=False is not supported")
        hidden = cfg.get("n_embd", 768)
        heads = cfg.get("n_head", 12)
        return cls(
            architecture="gpt2",
            model_type="gpt2",
            vocab_size=cfg.get("vocab_size", 50257),
            hidden_size=hidden,
            num_layers=cfg.get("n_layer", 12),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=cfg.get("n_inner") or 4 * hidden,
            max_model_len=cfg.get("n_positions", 1024),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            rope_theta=10000.0,  # unused: GPT-2 has learned absolute positions
            rope_scaling=None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            hidden_act=cfg.get("activation_function", "gelu_new"),
            bos_token_id=cfg.get("bos_token_id", 50256),
            eos_token_ids=eos_token_ids if "eos_token_id" in cfg else (50256,),
        )

    @classmethod
    def _from_llama_family(cls, cfg: dict[str, Any], model_type: str, eos_token_ids: tuple[int, ...]) -> ModelConfig:
        defaults = _FAMILY_DEFAULTS[model_type]
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        rope_theta, rope_scaling = _parse_rope(cfg)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        elif model_type == "qwen3" and cfg.get("head_dim") is None:
            cfg = {**cfg, "head_dim": 128}  # Qwen3Config's default, not hidden_size // heads
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        max_model_len = cfg.get("max_position_embeddings", defaults["max_position_embeddings"])
        # We attend over the whole context; a sliding window is exact only up to its width.
        window = cfg.get("sliding_window")
        if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
            max_model_len = min(max_model_len, window)
        return cls(
            architecture=MODEL_TYPES[model_type],
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            max_model_len=max_model_len,
            norm_eps=float(cfg.get("rms_norm_eps", defaults["rms_norm_eps"])),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", defaults["tie_word_embeddings"])),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
        )


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from transformers-5 ``rope_parameters`` or the older ``rope_theta`` +
    ``rope_scaling`` keys."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form; Llama-family models have one type
    merged = {**scaling, **params}
    rope_theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return rope_theta, None
    rope_scaling = {k: merged[k] for k in _LLAMA3_ROPE_KEYS if k in merged}
    if "original_max_position_embeddings" not in rope_scaling and "max_position_embeddings" in cfg:
        rope_scaling["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    rope_scaling["rope_type"] = rope_type
    return rope_theta, rope_scaling


def _read_json(path: pathlib.Path) -> dict:
    """A JSON object from a model file; ``ValueError`` naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value
