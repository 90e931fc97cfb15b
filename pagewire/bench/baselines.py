"""Hugging Face ``transformers`` baselines, run inside the bench process on the same model
directory, dtype, prompts and token counts as the pagewire runs.

- ``hf``: ``model.generate`` on static batches of ``batch_size`` prompts (left padding, greedy or
  the same temperature with top-k/top-p off). A batch runs until its longest member is done, so
  per-token times are not observable: only throughput and end-to-end latency are reported, and a
  request's latency is its batch's (every request of a batch is "sent" when the batch starts).
  With ``ignore_eos``, ``min_new_tokens = max_new_tokens`` makes every row produce exactly
  ``max_new_tokens`` tokens; note that ``min_new_tokens`` works by masking the EOS logits, so the
  tokens can differ from an engine that samples EOS and carries on (the counts match, which is
  what a throughput comparison needs). Without ``ignore_eos`` a row's tokens are counted up to and
  including its first EOS.
- ``hf-cb``: transformers' continuous batching (``ContinuousBatchingManager``: the engine behind
  ``model.generate_batch``), driven through its request API (``add_request`` / ``get_result``) so
  that requests arrive like ours: ``concurrency`` in flight (closed loop) or at the same Poisson
  send times. Its cache is sized like ours: ``page_size`` = our block size, ``num_blocks`` = the
  server's number of KV blocks, capped at what every sequence that can run at once needs at its
  full length (on CPU transformers' attention mask grows with the cache size, and blocks beyond
  that need are never used), ``max_batch_tokens`` = our step token budget,
  ``max_requests_per_batch`` = our ``max_num_seqs``, block sharing (its prefix cache) as ours. ``ignore_eos`` has no flag there:
  the generation config gets ``eos_token_id=-1``, which its requests treat as "no EOS".
  Its configuration moved between transformers 5 releases (``ContinuousBatchingConfig`` from 5.4,
  the page size named ``block_size`` there until 5.17 and ``page_size`` from 5.18, workload hints
  from 5.8, ``seed`` and ``max_requests_per_batch`` by 5.12; before 5.4 the cache settings are read
  from the generation config): each setting goes where the installed version takes it, and one it
  has no place for is left out and named in the run's details. (5.0's continuous batching cannot
  size its cache on a CPU, having no memory total there: on 5.0 hf-cb runs on a GPU only.)
  Per-token times come from ``record_timestamps=True``: they are stamped in its generation thread
  when each token is produced (no transport), so its TTFT/ITL are lower bounds next to ours,
  which are measured at a gRPC client in another process.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

from pagewire.bench.metrics import RequestRecord
from pagewire_common.sampling import DEFAULT_SAMPLING
from pagewire_common.settings import default_of

BASELINES = ("hf", "hf-cb")
# The KV budget our CPU worker uses when none is given (worker_svc.runner.DEFAULT_CPU_KV_CACHE_BYTES).
_CPU_KV_CACHE_BYTES = 1 << 30


# Each setting of transformers' continuous batching that hf-cb sets, under its current name, with the
# names it had before (first found wins): the page size was `block_size` up to transformers 5.17;
# 5.18 renamed it `page_size` and keeps `block_size` as a deprecated alias.
CB_NAMES: dict[str, tuple[str, ...]] = {
    "page_size": ("page_size", "block_size"),
    "num_blocks": ("num_blocks",),
    "max_batch_tokens": ("max_batch_tokens",),
    "max_requests_per_batch": ("max_requests_per_batch",),
    "allow_block_sharing": ("allow_block_sharing",),
    "seed": ("seed",),
}
# Before ContinuousBatchingConfig (transformers < 5.4) the cache reads these from the generation
# config, and block sharing is an argument of the context manager.
_GENERATION_CONFIG_CB_FIELDS = frozenset({"block_size", "num_blocks", "max_batch_tokens"})


def parameter_names(cls_or_fn) -> frozenset[str]:
    """The keyword arguments a dataclass (its fields) or a callable (its signature) takes."""
    if dataclasses.is_dataclass(cls_or_fn):
        return frozenset(f.name for f in dataclasses.fields(cls_or_fn) if f.init)
    return frozenset(inspect.signature(cls_or_fn).parameters)


def cb_kwargs(settings: dict[str, object], accepted: Collection[str]) -> tuple[dict[str, object], list[str]]:
    """``settings`` (keys of ``CB_NAMES``) as keyword arguments under the first of each one's names
    that ``accepted`` holds, and the settings none of whose names it holds (in ``settings``' order)."""
    kwargs: dict[str, object] = {}
    missing: list[str] = []
    for name, value in settings.items():
        found = next((n for n in CB_NAMES[name] if n in accepted), None)
        if found is None:
            missing.append(name)
        else:
            kwargs[found] = value
    return kwargs, missing


@dataclass(frozen=True, slots=True)
class CbSetup:
    """How one hf-cb run configures the installed transformers' continuous batching."""

    config: object | None  # its ContinuousBatchingConfig; None before transformers had one (< 5.4)
    generation_attrs: dict[str, object]  # set on the GenerationConfig (transformers < 5.4)
    context_kwargs: dict[str, object]  # more arguments of continuous_batching_context_manager
    applied: dict[str, object]  # our settings (CB_NAMES keys) that it took, with their values
    unsupported: list[str]  # our settings it has no place for, left out


@dataclass(frozen=True, slots=True)
class BaselineOptions:
    model_dir: Path
    dtype: str = "float32"
    device: str | None = None  # None: cuda if available, else cpu
    max_new_tokens: int = 128
    ignore_eos: bool = DEFAULT_SAMPLING.ignore_eos
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 32  # hf: prompts per static batch
    block_size: int = default_of("block_size")
    num_kv_blocks: int | None = None  # None: from kv_cache_bytes
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, transformers' choice on a GPU
    max_num_batched_tokens: int = default_of("max_num_batched_tokens")
    max_num_seqs: int = default_of("max_num_seqs")
    prefix_cache: bool = default_of("enable_prefix_caching")


class HFBaselines:
    """Loads the model once with ``AutoModelForCausalLM`` and runs either baseline on demand."""

    def __init__(self, options: BaselineOptions):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from worker_svc.config import ModelConfig
        from worker_svc.dtypes import parse_dtype

        self.options = o = options
        self.torch = torch
        self.device = torch.device(o.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = parse_dtype(o.dtype)
        hf_logging.disable_progress_bar()  # ours is the only bar on stderr
        self.model = AutoModelForCausalLM.from_pretrained(o.model_dir, dtype=self.dtype).to(self.device).eval()
        # the same EOS set our worker uses (config.json + generation_config.json)
        self.model_config = ModelConfig.from_pretrained(o.model_dir)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        pad = self.model.generation_config.pad_token_id
        if pad is None:
            pad = self.model.config.pad_token_id
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        self.last_cb_setup: CbSetup | None = None
        # transformers' continuous batching logs at INFO through a handler of its own
        import logging

        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)

    def describe(self) -> dict:
        return {
            "model_dir": str(self.options.model_dir),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
        }

    def _sampling_kwargs(self) -> dict:
        t = self.options.temperature
        if t > 0:
            return dict(do_sample=True, temperature=t, top_k=0, top_p=1.0)
        return dict(do_sample=False)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    # ---- hf: static batches -------------------------------------------------------------------

    def run_static(self, prompts: Sequence[list[int]], progress=None) -> tuple[list[RequestRecord], float]:
        """``model.generate`` on consecutive batches; returns one record per prompt (no per-token
        times; send/end are the batch's) and the total wall time."""
        from transformers import GenerationConfig

        torch = self.torch
        o = self.options
        gen_config = GenerationConfig(
            max_new_tokens=o.max_new_tokens,
            min_new_tokens=o.max_new_tokens if o.ignore_eos else None,
            eos_token_id=self.eos_token_ids or None,
            pad_token_id=self.pad_token_id,
            **self._sampling_kwargs(),
        )
        eos = set(self.eos_token_ids)
        torch.manual_seed(o.seed)
        records: list[RequestRecord] = []
        self._sync()
        start = perf_counter()
        with torch.inference_mode():
            for b in range(0, len(prompts), o.batch_size):
                batch = prompts[b : b + o.batch_size]
                width = max(len(p) for p in batch)
                input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
                attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
                for j, p in enumerate(batch):  # left padding
                    input_ids[j, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                    attention_mask[j, width - len(p) :] = 1
                t0 = perf_counter()
                out = self.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention_mask.to(self.device),
                    generation_config=gen_config,
                )
                generated = out[:, width:].tolist()  # syncs with the device
                t1 = perf_counter()
                for p, row in zip(batch, generated):
                    n = len(row)
                    if not o.ignore_eos:
                        n = next((k + 1 for k, t in enumerate(row) if t in eos), n)
                    records.append(RequestRecord(send_time=t0, end_time=t1, prompt_tokens=len(p), completion_tokens=n))
                if progress is not None:
                    progress.update(len(batch))
        return records, perf_counter() - start

    # ---- hf-cb: continuous batching -----------------------------------------------------------

    def _cb_num_blocks(self, page_size: int, max_seq_len: int, max_running: int) -> int | None:
        o = self.options
        num_blocks = o.num_kv_blocks
        if num_blocks is None:
            budget = o.kv_cache_bytes
            if budget is None:
                if self.device.type == "cuda":
                    return None  # transformers sizes it from free memory, as our worker does
                budget = _CPU_KV_CACHE_BYTES
            mc = self.model_config
            per_block = 2 * mc.num_layers * o.block_size * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize
            num_blocks = max(1, budget // per_block)
        needed = -(-max_seq_len // page_size) * max_running + 1
        return min(num_blocks, needed)

    def cb_settings(self, max_seq_len: int, max_running: int) -> dict[str, object]:
        """Our engine options as continuous-batching settings (``CB_NAMES`` keys) for sequences of
        up to ``max_seq_len`` tokens with up to ``max_running`` of them at once."""
        o = self.options
        page_size = max(4, o.block_size)  # transformers' minimum page is 4 tokens
        return {
            "page_size": page_size,
            "num_blocks": self._cb_num_blocks(page_size, max_seq_len, max_running),
            "max_batch_tokens": o.max_num_batched_tokens,
            "max_requests_per_batch": o.max_num_seqs,
            "allow_block_sharing": o.prefix_cache,
            "seed": o.seed,
        }

    def cb_setup(self, max_seq_len: int, max_running: int, workload_hints=None) -> CbSetup:
        """``cb_settings`` placed where the installed transformers takes them (see the module's
        docstring); ``workload_hints`` passed on where it takes them."""
        import transformers

        settings = self.cb_settings(max_seq_len, max_running)
        context_params = parameter_names(self.model.continuous_batching_context_manager)
        context_kwargs: dict[str, object] = {}
        if workload_hints is not None and "workload_hints" in context_params:
            context_kwargs["workload_hints"] = workload_hints
        config_cls = getattr(transformers, "ContinuousBatchingConfig", None)
        config, attrs = None, {}
        if config_cls is not None:
            kwargs, unsupported = cb_kwargs(settings, parameter_names(config_cls))
            config = context_kwargs["continuous_batching_config"] = config_cls(**kwargs)
        else:
            attrs, unsupported = cb_kwargs(settings, _GENERATION_CONFIG_CB_FIELDS)
            if "allow_block_sharing" in unsupported and "allow_block_sharing" in context_params:
                unsupported.remove("allow_block_sharing")
                context_kwargs["allow_block_sharing"] = settings["allow_block_sharing"]
        applied = {name: value for name, value in settings.items() if name not in unsupported}
        return CbSetup(config, attrs, context_kwargs, applied, unsupported)

    def run_continuous(
        self,
        prompts: Sequence[list[int]],
        *,
        concurrency: int | None = None,
        arrival_offsets: Sequence[float] | None = None,
        progress=None,
    ) -> tuple[list[RequestRecord], float]:
        """Requests through transformers' continuous batching manager, sent closed loop
        (``concurrency``) or at ``arrival_offsets``; one record per prompt with per-token times."""
        from transformers import GenerationConfig

        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
        except ImportError:  # transformers < 5.8
            WorkloadHints = None

        if (concurrency is None) == (arrival_offsets is None):
            raise ValueError("give exactly one of concurrency and arrival_offsets")
        o = self.options
        n = len(prompts)
        max_prompt_length = max(len(p) for p in prompts)
        hints = None if WorkloadHints is None else WorkloadHints(
            max_prompt_length=max_prompt_length, max_generated_length=o.max_new_tokens, num_requests=n)
        max_running = min(n, o.max_num_seqs, concurrency or n)
        self.last_cb_setup = setup = self.cb_setup(max_prompt_length + o.max_new_tokens, max_running, hints)
        gen_config = GenerationConfig(
            max_new_tokens=o.max_new_tokens,
            # no ignore_eos option in continuous batching: a negative EOS id means "no EOS"
            eos_token_id=-1 if o.ignore_eos else (self.eos_token_ids or -1),
            pad_token_id=self.pad_token_id,
            **self._sampling_kwargs(),
        )
        for name, value in setup.generation_attrs.items():
            setattr(gen_config, name, value)
        records = [RequestRecord(prompt_tokens=len(p)) for p in prompts]
        index_of: dict[str, int] = {}
        self.torch.manual_seed(o.seed)
        with self.model.continuous_batching_context_manager(
            generation_config=gen_config,
            block=True,
            timeout=60,
            **setup.context_kwargs,
        ) as manager:
            next_i = 0
            num_done = 0

            def submit(i: int) -> None:
                request_id = f"bench-{i}"
                index_of[request_id] = i
                records[i].send_time = perf_counter()
                manager.add_request(
                    prompts[i], request_id=request_id, max_new_tokens=o.max_new_tokens, record_timestamps=True
                )

            start = perf_counter()
            while num_done < n:
                wait = 1.0
                if concurrency is not None:
                    while next_i < n and next_i - num_done < concurrency:
                        submit(next_i)
                        next_i += 1
                else:
                    now = perf_counter()
                    while next_i < n and start + arrival_offsets[next_i] <= now:
                        submit(next_i)
                        next_i += 1
                    if next_i < n:
                        wait = max(0.0, min(wait, start + arrival_offsets[next_i] - perf_counter()))
                result = manager.get_result(timeout=wait) if wait > 0 else None
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped before finishing the run")
                    continue
                if not result.is_finished():
                    continue
                rec = records[index_of[result.request_id]]
                rec.end_time = perf_counter()
                if result.error is not None:
                    rec.error = "FAILED"
                    rec.error_message = str(result.error)
                else:
                    tokens = result.generated_tokens
                    # one stamp per kept token (transformers 5.0 also stamps the step past the
                    # length limit, whose token it drops)
                    stamps = (result.timestamps or [])[: len(tokens)]
                    rec.completion_tokens = len(tokens)
                    rec.arrival_times = list(stamps)
                    rec.arrival_counts = [1] * len(stamps)
                num_done += 1
                if progress is not None:
                    progress.update(1)
            duration = perf_counter() - start
        return records, duration
