"""pagewire: serve large language models over gRPC.

``from pagewire import LLM, SamplingParams`` for offline batch inference in one process.
``LLM`` is imported lazily: importing ``pagewire`` (the CLI, the client) never pulls in torch.
"""

from pagewire_common.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "GenerationOutput"):
        from worker_svc.cpu import features

        features.cap_torch_isa()  # PAGEWIRE_CPU_ISA: torch and oneDNN too, where torch is not imported yet
        from pagewire import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pagewire' has no attribute {name!r}")
