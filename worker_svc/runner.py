"""The step executor: applies a step plan to the paged KV cache and runs the model once.

Every scheduled token of the step, prefill chunks and decodes alike, is flattened into one
batch; positions and slot mappings are computed from flat arrays without a per-token Python
loop; the model writes all new K/V with one scatter per layer, attends over the paged cache,
and one token is sampled for each sequence that reached the end of its known tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvcache.paged import AttentionMetadata, PagedKVCache
from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.settings import Settings, check_all, default_of
from worker_svc.block_table import BlockTables
from worker_svc.config import ModelConfig
from worker_svc.cpu.prepare import prepare_model
from worker_svc.cuda_graphs import DecodeGraphs, compile_attention_kernels
from worker_svc.dtypes import AUTO, check_dtype_setting, dtype_name, resolve_dtype
from worker_svc.layers.linear import kv_heads_per_rank
from worker_svc.logits_adjust import LogitsAdjuster
from worker_svc.nvtx import nvtx_range
from worker_svc.parallel.group import SINGLE, TensorParallel
from worker_svc.plan_state import SeqState, SequenceStates
from worker_svc.sampler import Sampler, SamplingBatch
from worker_svc.step_io import (
    DeviceToHost,
    HostToDevice,
    LaunchedStep,
    Section,
    fill_sampled,
    layout,
)
from worker_svc.step_threads import StepThreads
from worker_svc.structured import GrammarMasks
from worker_svc.weights import load_model

log = logging.getLogger("pagewire.worker")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in fp32


def resolve_device(device: str | None) -> torch.device:
    """The ``--device`` setting, or cuda when it is available, else cpu; ``ValueError`` for a CUDA
    device this machine does not have."""
    resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this machine has no CUDA device (or torch is a CPU build)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


_RANK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_ranks_agree(tp: TensorParallel, dtype: torch.dtype) -> None:
    """Ranks on different machines may resolve ``auto`` differently (one CPU with native bf16, one
    without); their collectives need one dtype."""
    code = _RANK_DTYPES.index(dtype)
    if tp.size > 1 and tp.min_int(code) != -tp.min_int(-code):
        raise ValueError("the tensor-parallel ranks resolved --dtype auto to different dtypes (their devices differ); "
                         "pass --dtype explicitly")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Worker-side engine options: the worker's view of the settings
    (``pagewire_common.settings``), whose defaults and checks these are."""

    block_size: int = default_of("block_size")
    num_kv_blocks: int | None = default_of("num_kv_blocks")  # None: as many as kv_cache_bytes allows
    kv_cache_bytes: int | None = default_of("kv_cache_bytes")  # None: 1 GiB on CPU, 90% of free memory on CUDA
    dtype: str = default_of("dtype")
    device: str | None = default_of("device")  # None: cuda if available, else cpu
    max_model_len: int | None = default_of("max_model_len")  # None: the model's own
    # CUDA only: replay captured graphs for decode-only steps of up to this many sequences
    cuda_graphs: bool = default_of("cuda_graphs")
    cuda_graph_max_batch: int = default_of("cuda_graph_max_batch")
    # CPU: every attention chunk in C and every unrestricted row drawn from raw logits (batch-invariant)
    deterministic: bool = default_of("deterministic")
    launch_ahead: str = default_of("launch_ahead")  # auto: on CUDA with one rank
    quantization: str = default_of("quantization")  # CPU: int8 linears for a dense checkpoint
    gguf_weights: str = default_of("gguf_weights")  # CPU: a GGUF's own blocks, or its dequantized copy
    int8_activations: bool = default_of("int8_activations")  # CPU: quantized linears multiply int8 activations

    def __post_init__(self) -> None:
        check_all(self, ("block_size", "num_kv_blocks", "kv_cache_bytes", "max_model_len", "cuda_graph_max_batch",
                         "deterministic", "launch_ahead", "quantization", "gguf_weights", "int8_activations"))
        check_dtype_setting(self.dtype)

    @classmethod
    def from_settings(cls, settings: Settings) -> RunnerConfig:
        return cls(
            block_size=settings.block_size, num_kv_blocks=settings.num_kv_blocks,
            kv_cache_bytes=settings.kv_cache_bytes, dtype=settings.dtype, device=settings.device,
            max_model_len=settings.max_model_len, cuda_graphs=settings.cuda_graphs,
            cuda_graph_max_batch=settings.cuda_graph_max_batch, deterministic=settings.deterministic,
            launch_ahead=settings.launch_ahead,
            quantization=settings.quantization, gguf_weights=settings.gguf_weights,
            int8_activations=settings.int8_activations,
        )


@dataclass(slots=True)
class _StepInputs:
    num_seqs: int
    input_ids: torch.Tensor | None  # [T]; None: a decode graph's step (its inputs are in its static buffers)
    positions: torch.Tensor | None  # [T]
    meta: AttentionMetadata | None
    graph_size: int | None = None  # the captured batch size a decode step replays
    sampled_states: list[SeqState] = field(default_factory=list)
    sampled_seq_ids: list[int] = field(default_factory=list)
    sampled_positions: np.ndarray | None = None  # [N] the position of each token sampled
    version: int = 0  # ScheduledSeqs.version: equal versions and sampled, the same sampled states
    sampled: list[int] = field(default_factory=list)  # indices of the sampled rows in the batch
    # the positions that give prompt logprobs, when a sequence of the step asked; their logits
    # come first in the forward pass's output, before the sampled rows'
    prompt_rows: _PromptRows | None = None


@dataclass(slots=True)
class _PromptRows:
    """A step's positions whose logits give prompt logprobs (``StepResult``'s prompt fields)."""

    seq_ids: list[int]
    starts: list[int]  # per sequence: its first entry (= its first such position)
    counts: list[int]
    index: np.ndarray  # [E] int64: the positions' indices in the step's T tokens
    targets: np.ndarray  # [E] int64: the prompt token each position predicts
    num_top: int  # most top logprobs a sequence asks for
    device_targets: torch.Tensor | None = None  # [E] targets on the device


def _prompt_rows(states: list[SeqState], seq_ids: list[int], starts: np.ndarray, seq_lens: np.ndarray,
                 cu: np.ndarray) -> _PromptRows | None:
    """For each sequence that asked for prompt logprobs, the positions ``p`` of this step below
    ``P - 1`` (``P`` prompt tokens): the logits at ``p`` give prompt token ``p + 1``'s entry. A
    chunk's last position predicts the next chunk's first token, so a prompt computed in chunks
    gets every entry once."""
    ids, firsts, counts, index, targets = [], [], [], [], []
    num_top = 0
    for i, state in enumerate(states):
        want = state.sampling.prompt_logprobs
        if want is None:
            continue
        a, b = int(starts[i]), min(int(seq_lens[i]), state.num_prompt_tokens - 1)
        if a >= b:
            continue
        ids.append(seq_ids[i])
        firsts.append(a)
        counts.append(b - a)
        index.append(np.arange(cu[i], cu[i] + b - a, dtype=np.int64))
        targets.extend(state.token_ids[a + 1 : b + 1])
        num_top = max(num_top, want)
    if not ids:
        return None
    return _PromptRows(ids, firsts, counts, np.concatenate(index), np.asarray(targets, dtype=np.int64), num_top)


@dataclass(slots=True)
class _SamplingGroup:
    """The sampling parameters of one set of sampled rows, gathered once and kept while the step's
    sequences (``version``) and its sampled rows stay the same."""

    version: int
    sampled: list[int]
    batch: SamplingBatch
    want_logprobs: bool
    num_top: int  # most top logprobs a row asks for


class ModelRunner:
    """Holds the model and the paged KV cache; executes step plans.

    Under tensor parallelism (``tp.size > 1``) every rank runs one of these on its shard, with the
    same plans (``worker_svc.parallel``): rank 0 samples and returns the result; the others
    compute, then learn the sampled ids from rank 0 (``take_sampled``) before their next step.
    """

    def __init__(self, model_dir: str | Path, config: RunnerConfig | None = None, tp: TensorParallel = SINGLE):
        self.config = config = config or RunnerConfig()
        self.model_dir = Path(model_dir)
        self.tp = tp
        self.device = resolve_device(config.device)
        if config.int8_activations and self.device.type != "cpu":
            raise ValueError(f"--int8-activations runs on CPU (here: {self.device})")
        choice = resolve_dtype(config.dtype, self.device, ModelConfig.from_pretrained(self.model_dir).checkpoint_dtype,
                               int8_activations=config.int8_activations)
        self.dtype = choice.dtype
        if config.dtype == AUTO:
            _check_ranks_agree(tp, self.dtype)
        log.info("%s", choice.describe(config.dtype))
        self.model, self.model_config = load_model(self.model_dir, self.dtype, self.device, tp,
                                                   quantization=config.quantization, gguf_weights=config.gguf_weights)
        if self.device.type == "cpu":
            # the CPU kernels that fit (worker_svc.cpu)
            prepare_model(self.model, self.dtype, deterministic=config.deterministic,
                          int8_activations=config.int8_activations)
        mc: ModelConfig = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        if config.max_model_len and config.max_model_len > mc.max_model_len:
            log.warning("--max-model-len %d is more than the model's %d positions: serving %d",
                        config.max_model_len, mc.max_model_len, mc.max_model_len)
        # this rank's KV heads; every rank holds the same block ids, each for its own heads
        num_kv_heads = kv_heads_per_rank(mc.num_kv_heads, tp)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = config.kv_cache_bytes or self._default_kv_budget()
            num_blocks = PagedKVCache.num_blocks_for_budget(
                budget, mc.num_layers, config.block_size, num_kv_heads, mc.head_dim, self.dtype
            )
            num_blocks = tp.min_int(num_blocks)  # what every rank can hold
            if num_blocks < 1:
                raise ValueError(f"a KV cache budget of {budget} bytes holds no block of {config.block_size} tokens")
        try:
            self.kv_cache = PagedKVCache(
                mc.num_layers, num_blocks, config.block_size, num_kv_heads, mc.head_dim, self.dtype, self.device
            )
        except (RuntimeError, MemoryError) as e:  # torch's CPU allocator, or CUDA out of memory
            size = PagedKVCache.bytes_per_block(mc.num_layers, config.block_size, num_kv_heads, mc.head_dim,
                                                self.dtype) * num_blocks
            raise ValueError(f"cannot allocate the KV cache ({num_blocks} blocks, {size / 2**30:.1f} GiB) on "
                             f"{self.device}: {str(e).splitlines()[0]}; give less --kv-cache-memory or "
                             "--num-kv-blocks") from None
        self.block_size = config.block_size
        max_blocks_per_seq = -(-self.max_model_len // config.block_size)
        self.block_tables = BlockTables(max_blocks_per_seq, self.device)
        self.sampler = Sampler(self.device, deterministic=config.deterministic)
        # only rank 0 adjusts logits and samples: the other ranks keep no adjustment state
        self.adjuster = LogitsAdjuster(mc.vocab_size, self.device, self._grammar_masks() if tp.is_first else None)
        compile_attention_kernels(self.model, self.kv_cache)  # no step waits for Triton's compiler
        self.decode_graphs: DecodeGraphs | None = None
        # collectives are not captured in graphs: steps of several ranks run eagerly
        if self.device.type == "cuda" and config.cuda_graphs and tp.size == 1:
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_cache, config.cuda_graph_max_batch, self.max_model_len,
                max_blocks_per_seq, self.device,
            )
            self.decode_graphs.capture_all()
        # per-sequence state; plans are applied and checked there, by the same code as NullRunner's
        self.seqs = SequenceStates(self.block_tables, config.block_size, num_blocks)
        self.num_block_copies = 0
        # ranks other than 0: the sequences that sampled in the last step, until rank 0's ids come
        self._awaiting_tokens: list[SeqState] = []
        self._sampling: _SamplingGroup | None = None
        self._to_device = HostToDevice(self.device)
        # launch each step before the last one's tokens reach the host (see launch); where that
        # gains nothing (CPU, whose kernels run as they are called) only when asked
        mode = config.launch_ahead
        self.launch_ahead = tp.size == 1 and (mode == "on" or (mode == "auto" and self.device.type == "cuda"))
        self._ahead: tuple[LaunchedStep, torch.Tensor] | None = None  # the last step launched ahead, its tokens
        self._num_unfinished = 0  # steps launched ahead and not yet finished
        self.num_steps_fed_from_device = 0  # steps with input ids sampled by an unfinished step (observability)
        # CPU: each step on one thread or all, whichever its size ran faster on lately (step_threads)
        self._step_threads = StepThreads(torch.get_num_threads()) if self.device.type == "cpu" else None
        log.debug(
            "model runner: %s architecture, %s on %s, %d KV blocks of %d tokens, max model length %d",
            mc.model_type, dtype_name(self.dtype), self.device, num_blocks, config.block_size, self.max_model_len,
        )

    def _grammar_masks(self) -> GrammarMasks | None:
        mc = self.model_config
        return GrammarMasks.for_model(self.model_dir, mc.vocab_size, mc.eos_token_ids, self.device)

    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return DEFAULT_CPU_KV_CACHE_BYTES

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def structured_output(self) -> bool:
        """Whether it can constrain outputs to a grammar (``GrammarMasks.for_model`` built masks)."""
        return self.adjuster.grammars is not None

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def reset(self) -> None:
        """Drop all per-sequence state (the scheduler reconnected and starts from scratch)."""
        self.seqs.reset()
        self.adjuster.reset()
        self._awaiting_tokens = []
        self._sampling = None
        self._ahead = None
        self._num_unfinished = 0

    def take_sampled(self, token_ids: list[int]) -> None:
        """On a rank other than 0: the ids rank 0 sampled in the last step, in its batch order."""
        states, self._awaiting_tokens = self._awaiting_tokens, []
        if len(token_ids) != len(states):
            raise ValueError(f"{len(token_ids)} sampled ids for {len(states)} sequences that sampled")
        for state, token in zip(states, token_ids):
            state.token_ids.append(token)

    # ---- one step -----------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step and return its result."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Apply ``plan`` and queue its step on the device. Launched ahead (``launch_ahead``), the
        step's sampled tokens stay on the device: the next step takes its input ids from there,
        so it can be launched before this one's tokens reach the host. Steps are finished in the
        order they were launched, and at most one may be unfinished when the next is launched."""
        chooser = self._step_threads
        if chooser is None or plan.is_empty:
            return self._launch(plan)
        process_threads = torch.get_num_threads()
        if chooser.num_threads != process_threads:  # the process changed its count: measure anew
            self._step_threads = chooser = StepThreads(process_threads)
        num_tokens = plan.num_scheduled_tokens
        threads = chooser.pick(num_tokens)
        if threads != process_threads:
            torch.set_num_threads(threads)
        start = chooser.clock()
        try:
            launched = self._launch(plan)
        finally:
            if threads != process_threads:
                torch.set_num_threads(process_threads)  # the process's own count outside the step
        chooser.record(num_tokens, threads, chooser.clock() - start)
        return launched

    def finish(self, launched: LaunchedStep) -> StepResult:
        """``launched``'s result, once its tokens are on the host (waits for the device)."""
        result, states = launched.result, launched.states
        if states is None:
            return result
        with nvtx_range("wait for tokens"):
            host = launched.outputs.wait()
        token_list = host[0].tolist()
        for state, slot, token in zip(states, launched.slots, token_list):
            state.token_ids[slot] = token  # the placeholder the next step's inputs saw
        if self._ahead is not None and self._ahead[0] is launched:
            self._ahead = None
        launched.states = None
        self._num_unfinished -= 1
        top = host[-2:] if launched.num_top else None
        fill_sampled(result, token_list, host[1].tolist() if launched.want_logprobs else None, launched.params,
                      launched.num_top, top)
        return result

    @torch.inference_mode()
    def _launch(self, plan: StepPlan) -> LaunchedStep:
        with nvtx_range("apply plan"):
            adjuster = self.adjuster
            if adjuster.num_adjusted:
                for seq_id in plan.finished_seq_ids:
                    state = self.seqs.get(seq_id)
                    if state is not None and state.is_adjusted:
                        adjuster.drop(state)
            copies = self.seqs.apply(plan)  # checks the plan: KeyError/ValueError if it contradicts our state
            if self.tp.is_first:
                for new in plan.new_seqs:
                    adjuster.add(self.seqs.get(new.seq_id))
            if copies:
                self.kv_cache.copy_blocks(copies)
                self.num_block_copies += len(copies)
        result = StepResult(step_id=plan.step_id)
        if plan.is_empty:
            return LaunchedStep(result)
        with nvtx_range("prepare inputs"):
            inputs = self._prepare_inputs(plan)
        meta = inputs.meta
        grammars = adjuster.grammars
        grammar_step = grammars is not None and grammars.num_active > 0
        if grammar_step:
            grammars.start(inputs.sampled_states)  # the masks are filled while the model runs
        prompt_rows = inputs.prompt_rows
        if inputs.graph_size is not None:
            with nvtx_range("decode graph"):
                logits = self.decode_graphs.replay(inputs.num_seqs, inputs.graph_size)
        else:
            with nvtx_range("forward"):
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, meta)
                if not inputs.sampled_states and prompt_rows is None:
                    return LaunchedStep(result)
                logits = self.model.compute_logits(hidden)  # [num_prompt_rows + num_sampled, vocab] fp32
            if logits is None:  # a rank other than 0: rank 0 samples (and adjusts the logits)
                self._awaiting_tokens = inputs.sampled_states
                return LaunchedStep(result)
            if prompt_rows is not None:
                num_prompt_rows = len(prompt_rows.index)
                with nvtx_range("prompt logprobs"):
                    self._prompt_logprobs(logits[:num_prompt_rows], prompt_rows, result)
                logits = logits[num_prompt_rows:]
                if not inputs.sampled_states:
                    return LaunchedStep(result)
        states = inputs.sampled_states
        group = self._sampling_group(inputs)
        batch = group.batch
        batch.positions = inputs.sampled_positions
        params = batch.params
        want_logprobs = group.want_logprobs
        num_top = group.num_top
        result.seq_ids = inputs.sampled_seq_ids
        with nvtx_range("sample"):
            # logprobs are the model's distribution, before any adjustment
            raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs or num_top else None
            adjuster.apply(logits, states)
            tokens, _ = self.sampler(logits, batch)
            adjuster.record(tokens)
            outputs = [tokens]
            if want_logprobs:
                outputs.append(raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1))
            if num_top:
                outputs.extend(raw_logprobs.topk(num_top, dim=-1)[::-1])  # ids, logprobs [N, num_top], best first
            if self.launch_ahead and not grammar_step:  # a grammar's matchers need the tokens now
                if self._num_unfinished > 1:
                    raise RuntimeError("launched a step while two steps launched ahead were unfinished")
                self._num_unfinished += 1
                launched = LaunchedStep(result, states, None, DeviceToHost.start(outputs), params, want_logprobs,
                                        num_top)
                slots = []
                for i, state in enumerate(states):
                    ids = state.token_ids
                    slots.append(len(ids))
                    ids.append(~i)  # placeholder: row i of this step's tokens, on the device
                launched.slots = slots
                self._ahead = (launched, tokens)
                return launched
            host = [t.cpu() for t in outputs]  # the step's device -> host sync (on CUDA: waits for the GPU)
            token_list = host[0].tolist()
        for state, token in zip(states, token_list):
            state.token_ids.append(token)
        if grammar_step:
            grammars.advance(states, token_list)
        fill_sampled(result, token_list, host[1].tolist() if want_logprobs else None, params, num_top,
                      host[-2:] if num_top else None)
        return LaunchedStep(result)

    def _prompt_logprobs(self, logits: torch.Tensor, rows: _PromptRows, result: StepResult) -> None:
        """Fill ``result``'s prompt fields from the logits of ``rows``' positions: the model's
        distribution, before any adjustment (as ``logprobs``)."""
        logprobs = torch.log_softmax(logits, dim=-1)  # [E, vocab]
        targets = rows.device_targets
        result.prompt_seq_ids = rows.seq_ids
        result.prompt_starts = rows.starts
        result.prompt_counts = rows.counts
        result.prompt_logprobs = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).cpu().numpy()
        result.num_prompt_top_logprobs = rows.num_top
        if rows.num_top:
            top_logprobs, top_ids = logprobs.topk(rows.num_top, dim=-1)  # [E, k], best first
            result.prompt_top_token_ids = top_ids.to(torch.int32).cpu().numpy()
            result.prompt_top_logprobs = top_logprobs.cpu().numpy()
        else:
            result.prompt_top_token_ids = np.zeros((len(rows.targets), 0), dtype=np.int32)
            result.prompt_top_logprobs = np.zeros((len(rows.targets), 0), dtype=np.float32)

    def _sampling_group(self, inputs: _StepInputs) -> _SamplingGroup:
        group = self._sampling
        if group is None or group.version != inputs.version or group.sampled != inputs.sampled:
            params = [s.sampling for s in inputs.sampled_states]
            self._sampling = group = _SamplingGroup(
                inputs.version, inputs.sampled, SamplingBatch(params, inputs.sampled_positions, want_logprobs=False),
                any(p.logprobs for p in params), max(p.top_logprobs for p in params),
            )
        return group

    def _prepare_inputs(self, plan: StepPlan) -> _StepInputs:
        batch = self.seqs.scheduled(plan)  # checks every scheduled sequence before changing any
        block_size = self.block_size
        states = batch.states
        num_seqs = len(states)
        query_lens = batch.query_lens
        seq_lens = batch.seq_lens
        starts = seq_lens - query_lens
        rows = batch.rows
        num_blocks = batch.num_blocks
        num_tokens = int(query_lens.sum())
        max_query_len = int(query_lens.max())
        sampled = batch.sampled

        if max_query_len == 1 and num_tokens == num_seqs:  # decodes: sequence i computes token i
            cu = np.arange(num_seqs + 1, dtype=np.int64)
            seq_index = cu[:-1]
            positions = starts
            input_ids = np.fromiter((s.token_ids[a] for s, a in zip(states, starts.tolist())),
                                    dtype=np.int64, count=num_tokens)
        else:
            cu = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(query_lens, out=cu[1:])
            # token t belongs to sequence seq_index[t] and sits at positions[t]
            seq_index = np.repeat(np.arange(num_seqs), query_lens)
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - starts, query_lens)
            input_ids = np.fromiter(
                (t for state, a, b in zip(states, starts.tolist(), seq_lens.tolist()) for t in state.token_ids[a:b]),
                dtype=np.int64,
                count=num_tokens,
            )
        host_table = self.block_tables.host
        slot_mapping = host_table[rows[seq_index], positions // block_size].astype(np.int64) * block_size + positions % block_size

        all_sampled = len(sampled) == num_seqs
        # a list index costs numpy a conversion per element: none when every sequence samples
        sampled_index = slice(None) if all_sampled else np.asarray(sampled, dtype=np.int64)
        logits_indices = cu[1:][sampled_index] - 1
        prompt_rows = None
        # only a step with a prompt chunk can hold a position below its prompt's last
        if max_query_len > 1 or not all_sampled:
            prompt_rows = _prompt_rows(states, batch.seq_ids, starts, seq_lens, cu)
            if prompt_rows is not None:
                logits_indices = np.concatenate([prompt_rows.index, logits_indices])

        # tokens the step launched ahead sampled are placeholders (~row) here: their ids come from
        # its token tensor on the device, all of it in batch order in a run of decode steps
        pending = np.flatnonzero(input_ids < 0)
        from_device = None  # the launched-ahead step's tokens: all of them, in order, are the input ids
        extra: list[Section] = []
        if pending.size:
            if self._ahead is None:
                raise RuntimeError("a step's input token was sampled by a step that already finished")
            ahead_tokens = self._ahead[1]
            self.num_steps_fed_from_device += 1
            src = ~input_ids[pending]
            if pending.size == num_tokens == ahead_tokens.shape[0] and (src == pending).all():
                from_device = ahead_tokens
            else:
                extra = [Section(pending.astype(np.int64), torch.int64), Section(src, torch.int64)]

        graphs = self.decode_graphs
        graph_size = None
        if graphs is not None and max_query_len == 1 and all_sampled and graphs.fits(num_seqs):
            graph_size = graphs.padded_size(num_seqs)
        h2d = self._to_device
        meta = None
        if graph_size is not None:  # straight into the graph's static buffers
            sections = graphs.sections(graph_size, input_ids, positions, slot_mapping, seq_lens)
            sections.append(Section(rows, torch.int64))
            layout(sections[4:] + extra, graphs.static_end)
            staged = h2d.stage(sections + extra, dest=graphs.inputs)
            torch.index_select(self.block_tables.table, 0, staged[4], out=graphs.block_tables[:num_seqs])
            device_ids = graphs.input_ids[:num_seqs]
            device_positions = None
            if from_device is not None:
                device_ids.copy_(from_device)
        else:
            sections = [Section(a, dtype) for a, dtype in (
                (slot_mapping, torch.int64), (cu, torch.int32), (seq_lens, torch.int32), (rows, torch.int64),
                (logits_indices, torch.int64), (input_ids, torch.int64), (positions, torch.int64))]
            if prompt_rows is not None:
                sections.append(Section(prompt_rows.targets, torch.int64))
            staged = h2d.stage(sections + extra)
            if prompt_rows is not None:
                prompt_rows.device_targets = staged[7]
            device_ids, device_positions = staged[5], staged[6]
            if from_device is not None:
                device_ids = from_device
            meta = AttentionMetadata(
                slot_mapping=staged[0],
                query_start_loc=staged[1],
                seq_lens=staged[2],
                block_tables=self.block_tables.gather(rows, int(num_blocks.max()), staged[3]),
                max_query_len=max_query_len,
                max_seq_len=int(seq_lens.max()),
                query_lens_cpu=query_lens.tolist(),
                seq_lens_cpu=seq_lens.tolist(),
                logits_indices=staged[4],
            )
        if extra:  # some input ids from the device
            device_ids[staged[-2]] = self._ahead[1][staged[-1]]
        batch.advance()
        if all_sampled:
            sampled_states, sampled_seq_ids = states, batch.seq_ids
        else:
            sampled_states = [states[i] for i in sampled]
            sampled_seq_ids = [batch.seq_ids[i] for i in sampled]
        return _StepInputs(
            num_seqs=num_seqs,
            input_ids=device_ids,
            positions=device_positions,
            meta=meta,
            graph_size=graph_size,
            sampled_states=sampled_states,
            sampled_seq_ids=sampled_seq_ids,
            sampled_positions=seq_lens[sampled_index],
            version=batch.version,
            sampled=sampled,
            prompt_rows=prompt_rows,
        )
