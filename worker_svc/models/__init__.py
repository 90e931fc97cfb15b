"""Model implementations, chosen by ``ModelConfig.architecture``."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from worker_svc.config import ModelConfig
from worker_svc.layers import RotaryEmbedding
from worker_svc.models.gpt2 import GPT2LMHeadModel
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.qwen3 import Qwen3ForCausalLM
from worker_svc.parallel.group import SINGLE, TensorParallel

_MODELS: dict[str, type[nn.Module]] = {
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    """The model class for ``config.architecture``."""
    try:
        return _MODELS[config.architecture]
    except KeyError:
        raise ValueError(
            f"no model for architecture {config.architecture!r}; supported: {', '.join(_MODELS)}"
        ) from None


class _SkipInit(TorchFunctionMode):
    """Skips ``torch.nn.init``'s initializers while modules are built: ``load_weights`` overwrites
    every parameter, and on the meta device these initializers run through ``torch._refs``, whose
    first use imports ``torch._dynamo`` (about 2 s, Triton with it when installed, and a
    ``torchinductor`` folder in the temp directory)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")  # what the initializer would return
        return func(*args, **kwargs)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                tp: TensorParallel = SINGLE) -> nn.Module:
    """An inference-only model in ``dtype`` on ``device`` (this rank's shard of it under ``tp``). Its
    parameters are UNINITIALIZED (no random init is spent on weights that load_weights overwrites, and
    load_weights fails on any missing one); its derived buffers (rotary tables) are computed."""
    cls = get_model_class(config)
    with torch.device("meta"), _SkipInit():
        model = cls(config, tp)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
    model.requires_grad_(False)
    return model.eval()
