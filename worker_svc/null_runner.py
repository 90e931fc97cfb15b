"""A worker runner that does no math: it measures the control plane (scheduler, gRPC, streaming).

``NullRunner`` has the interface the worker server uses from ``ModelRunner`` (``execute``,
``reset``, ``model_config``, ``model_dir``, ``max_model_len``, ``block_size``, ``num_kv_blocks``,
``dtype``, ``device``, ``num_seqs``) and keeps its per-sequence state (token lists, computed
counts, block tables) in the same ``SequenceStates`` (``plan_state.py``), so a plan is applied and
checked by the very same code and a control-plane bug still surfaces as a rejected plan. Instead of running a model it "samples" a fixed cycle of ordinary token ids: the token at
position ``p`` is ``cycle[p % len(cycle)]``, so outputs depend only on positions (identical with
overlap on and off, whatever the batch) and never end a request early through EOS. A request with
a grammar gets the cycle's token where the grammar allows it, else EOS where allowed, else the
lowest allowed id, so its output still follows the grammar (and the grammar's host cost is paid).

It reads ``config.json`` and the tokenizer files of a real model directory (so text prompts, the
chat template and detokenization work as usual) but loads no weights and allocates no KV cache,
so the default number of KV blocks is large.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.sampling import MAX_TOP_LOGPROBS
from worker_svc.block_table import BlockTables
from worker_svc.config import ModelConfig
from worker_svc.plan_state import SequenceStates
from worker_svc.structured import GrammarMasks

log = logging.getLogger("pagewire.worker")

# 1M tokens at the default block size: enough that admission is never limited by KV blocks, small
# enough that the scheduler's allocator (a few flat lists of num_blocks ints) stays a few MiB.
DEFAULT_NULL_KV_BLOCKS = 1 << 16
# Text whose tokens make the fixed output cycle: ordinary words, so the scheduler's incremental
# detokenizer does its usual work.
_CYCLE_TEXT = " the quick brown fox jumps over the lazy dog and then it runs back home again"
_CYCLE_LEN = 16


class NullRunner:
    """Follows step plans like ``ModelRunner`` and returns fixed tokens without any model math."""

    def __init__(self, model_dir: str | Path, config=None):
        # the real runner's options, device and dtype choice
        from worker_svc.dtypes import dtype_name, resolve_dtype
        from worker_svc.runner import RunnerConfig, resolve_device

        self.config = config = config or RunnerConfig()
        self.model_dir = Path(model_dir)
        self.model_config: ModelConfig = ModelConfig.from_pretrained(self.model_dir)
        mc = self.model_config
        self.device = "null"
        # the dtype the real worker would pick here (``auto`` resolved the same way): it sizes the
        # pretend cache from --kv-cache-memory and is what Info reports
        choice = resolve_dtype(config.dtype, resolve_device(config.device), mc.checkpoint_dtype)
        self.dtype = dtype_name(choice.dtype)
        log.info("%s", choice.describe(config.dtype))
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.block_size = config.block_size
        # the real runner's block-table width: a longer table is a scheduler bug
        self.max_blocks_per_seq = -(-self.max_model_len // config.block_size)
        if config.num_kv_blocks is not None:
            self.num_kv_blocks = config.num_kv_blocks
        elif config.kv_cache_bytes is not None:
            per_block = 2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim * choice.dtype.itemsize
            self.num_kv_blocks = config.kv_cache_bytes // per_block
            if self.num_kv_blocks < 1:
                raise ValueError(
                    f"a KV cache budget of {config.kv_cache_bytes} bytes holds no block of {config.block_size} tokens"
                )
        else:
            self.num_kv_blocks = DEFAULT_NULL_KV_BLOCKS
        self.token_cycle = _token_cycle(self.model_dir, mc)
        # distinct ids for the top-logprobs lists: the cycle's, then the vocabulary's first
        pool = list(dict.fromkeys(self.token_cycle))
        self.top_pool = pool + [t for t in range(min(mc.vocab_size, 4 * MAX_TOP_LOGPROBS)) if t not in pool]
        # structured output: the cycle's token where the grammar allows it, else an allowed one
        self.grammars = GrammarMasks.for_model(self.model_dir, mc.vocab_size, mc.eos_token_ids, "cpu")
        # the real runner's per-sequence state and plan checks; block tables in host memory only
        self.seqs = SequenceStates(
            BlockTables(self.max_blocks_per_seq, "cpu"), self.block_size, self.num_kv_blocks
        )
        self.num_block_copies = 0
        log.debug(
            "null runner: %s config, no model math, %d KV blocks of %d tokens (none allocated), "
            "max model length %d, output cycle %s",
            mc.model_type, self.num_kv_blocks, self.block_size, self.max_model_len, self.token_cycle,
        )

    @property
    def structured_output(self) -> bool:
        return self.grammars is not None

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def reset(self) -> None:
        """Drop all per-sequence state (the scheduler reconnected and starts from scratch)."""
        self.seqs.reset()
        if self.grammars is not None:
            self.grammars.reset()

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply ``plan`` to the per-sequence state and "sample" one token for every sequence
        that reached the end of its known tokens. Raises ``KeyError``/``ValueError`` for a plan
        that contradicts the state, as ``ModelRunner`` does."""
        grammars = self.grammars
        if grammars is not None and grammars.num_active:
            for seq_id in plan.finished_seq_ids:
                state = self.seqs.get(seq_id)
                if state is not None:
                    grammars.drop(state)
        copies = self.seqs.apply(plan)
        for new in plan.new_seqs:
            if new.sampling.structured_output is not None:
                if grammars is None:
                    raise ValueError("structured output needs the model's tokenizer.json, which this worker lacks")
                grammars.add(self.seqs.get(new.seq_id))
        self.num_block_copies += len(copies)  # nothing to copy: there is no cache
        result = StepResult(step_id=plan.step_id)
        if plan.is_empty:
            return result
        batch = self.seqs.scheduled(plan)  # checks every scheduled sequence before changing any
        batch.advance()
        seq_ids = result.seq_ids
        token_ids = result.token_ids
        cycle = self.token_cycle
        cycle_len = len(cycle)
        all_seq_ids = batch.seq_ids
        states = batch.states
        params = []
        for i in batch.sampled:
            state = states[i]
            tokens = state.token_ids
            token = cycle[len(tokens) % cycle_len]
            if state.matcher is not None:
                token = grammars.choose(state, token)
                grammars.advance((state,), (token,))
            tokens.append(token)
            seq_ids.append(all_seq_ids[i])
            token_ids.append(token)
            params.append(state.sampling)
        _fill_logprobs(result, params, self.top_pool)
        return result


# a top-logprobs entry below the emitted token's: the null runner's tokens are certain
NULL_OTHER_LOGPROB = -1e4


def _fill_logprobs(result: StepResult, params: list, pool: list[int]) -> None:
    """Logprobs of the shape a model's step gives, when a row asks: its token is certain (0.0),
    and a top list is that token first, then other ids of ``pool`` at ``NULL_OTHER_LOGPROB``."""
    if any(p.logprobs for p in params):
        result.logprobs = [0.0 if p.logprobs else float("nan") for p in params]
    num_top = max((p.top_logprobs for p in params), default=0)
    if num_top:
        result.num_top_logprobs = num_top
        top_ids: list[int] = []
        for token in result.token_ids:
            top_ids.append(token)
            top_ids.extend([t for t in pool[:num_top] if t != token][: num_top - 1])
        result.top_token_ids = top_ids
        result.top_logprobs = [0.0 if k == 0 else NULL_OTHER_LOGPROB for _ in result.token_ids
                               for k in range(num_top)]


def _token_cycle(model_dir: Path, mc: ModelConfig) -> list[int]:
    """Ordinary (non-special, non-EOS) token ids to emit in turn: the tokens of a plain sentence
    when the model has a tokenizer, else the first ordinary ids of the vocabulary."""
    excluded = set(mc.eos_token_ids)
    if mc.bos_token_id is not None:
        excluded.add(mc.bos_token_id)
    ids: list[int] = []
    path = model_dir / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        excluded |= {tid for tid, t in tok.get_added_tokens_decoder().items() if t.special}
        ids = [t for t in tok.encode(_CYCLE_TEXT, add_special_tokens=False).ids if t not in excluded]
    ids = [t for t in ids if t < mc.vocab_size][:_CYCLE_LEN]
    if not ids:
        ids = [t for t in range(min(mc.vocab_size, 64)) if t not in excluded][:_CYCLE_LEN]
    if not ids:
        raise ValueError(f"the model in {model_dir} has no ordinary token id to emit")
    return ids
