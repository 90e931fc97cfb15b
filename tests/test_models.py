"""Our GPT-2 / Llama-family models over the paged cache against transformers' own, in fp32."""

from __future__ import annotations

import random

import pytest
import torch

from kvcache.paged import AttentionMetadata, PagedKVCache
from worker_svc.config import ModelConfig
from worker_svc.models import build_model, get_model_class
from worker_svc.weights import load_model

BLOCK_SIZE = 4
VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These models are tiny: one thread is fastest, and it avoids OpenMP barrier stalls (10x slower
    steps) when the machine's few cores are busy with other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """HF initializes biases to 0 and norms to 1; give every parameter a value so loading is tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.copy_(1.0 + noise if "norm" in name or ".ln_" in name else noise)


def hf_tiny(kind: str, tmp_path):
    """Build a tiny random transformers model of ``kind``, save it, return (hf_model, dir)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    llama_like = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, max_position_embeddings=128)
    if kind == "gpt2":
        config = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
        model = tf.GPT2LMHeadModel(config)
    elif kind == "llama_gqa_tied":
        config = tf.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **llama_like, **common)
        model = tf.LlamaForCausalLM(config)
    elif kind == "llama_untied":
        config = tf.LlamaConfig(num_key_value_heads=6, tie_word_embeddings=False, **llama_like, **common)
        model = tf.LlamaForCausalLM(config)
    elif kind == "llama_bias_llama3_rope":
        rope = dict(rope_type="llama3", rope_theta=50000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)
        config = tf.LlamaConfig(num_key_value_heads=3, attention_bias=True, mlp_bias=True, rope_parameters=rope,
                                head_dim=16, **llama_like, **common)
        model = tf.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **llama_like, **common)
        model = tf.Qwen2ForCausalLM(config)
    elif kind == "mistral":
        config = tf.MistralConfig(num_key_value_heads=3, sliding_window=None, **llama_like, **common)
        model = tf.MistralForCausalLM(config)
    else:
        raise AssertionError(kind)
    randomize(model)
    model.eval()
    model.save_pretrained(tmp_path)
    return model, tmp_path


class PagedRunner:
    """Drives our model step by step like the worker: blocks from a shuffled pool, flattened tokens."""

    def __init__(self, model, config: ModelConfig, num_blocks: int = 64, seed: int = 0):
        self.model = model
        self.cache = PagedKVCache(config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim,
                                  torch.float32, "cpu")
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_ids: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def step(self, scheduled: list[tuple[int, list[int]]], last_only: bool = False) -> list[torch.Tensor]:
        """scheduled: (seq_id, new token ids). Returns each sequence's logits for all its new tokens
        (for its last token only with ``last_only``)."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq_id, tokens in scheduled:
            blocks = self.block_ids.setdefault(seq_id, [])
            start = self.num_computed.get(seq_id, 0)
            for pos in range(start, start + len(tokens)):
                if pos // BLOCK_SIZE == len(blocks):
                    blocks.append(self.free_blocks.pop())
                slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            input_ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            self.num_computed[seq_id] = start + len(tokens)
        max_blocks = max(len(self.block_ids[s]) for s, _ in scheduled)
        table = torch.zeros((len(scheduled), max_blocks), dtype=torch.int32)
        for row, (seq_id, _) in enumerate(scheduled):
            table[row, : len(self.block_ids[seq_id])] = torch.tensor(self.block_ids[seq_id], dtype=torch.int32)
        cu = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=cu,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            logits_indices=cu[1:].long() - 1 if last_only else torch.arange(len(input_ids), dtype=torch.int64),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.cache, meta)
            logits = self.model.compute_logits(hidden)
        num_sampled = len(scheduled) if last_only else len(input_ids)
        assert hidden.shape == (num_sampled, self.model.config.hidden_size)
        assert logits.dtype == torch.float32 and logits.shape == (num_sampled, VOCAB)
        return list(logits.split([1] * len(scheduled) if last_only else query_lens))


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def prompts(seed: int) -> list[list[int]]:
    gen = random.Random(seed)
    return [[gen.randrange(VOCAB) for _ in range(n)] for n in (5, 9, 1, 12, 4)]


KINDS = ["gpt2", "llama_gqa_tied", "llama_untied", "llama_bias_llama3_rope", "qwen2", "mistral"]


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_prefill_matches_transformers(kind, tmp_path):
    hf_model, model_dir = hf_tiny(kind, tmp_path)
    model, config = load_model(model_dir, torch.float32, "cpu")
    assert isinstance(model, get_model_class(config))
    runner = PagedRunner(model, config)
    batch = prompts(seed=1)
    outs = runner.step(list(enumerate(batch)))
    for tokens, out in zip(batch, outs):
        torch.testing.assert_close(out, hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_then_decodes_match_transformers(kind, tmp_path):
    hf_model, model_dir = hf_tiny(kind, tmp_path)
    model, config = load_model(model_dir, torch.float32, "cpu")
    runner = PagedRunner(model, config, seed=5)
    batch = prompts(seed=2)
    split = [3, 4, 0, 11, 4]  # tokens of each prompt in step 1 (0: not scheduled; 11 of 12: a 1-token chunk next)
    runner.step([(i, p[:k]) for i, (p, k) in enumerate(zip(batch, split)) if k])
    outs = runner.step([(i, p[k:]) for i, (p, k) in enumerate(zip(batch, split)) if k < len(p)])
    rest = [i for i, (p, k) in enumerate(zip(batch, split)) if k < len(p)]
    for i, out in zip(rest, outs):
        torch.testing.assert_close(out, hf_logits(hf_model, batch[i])[split[i]:], atol=1e-4, rtol=1e-4)
    # greedy decodes for every sequence at once (all q_len == 1), crossing block boundaries
    sequences = [list(p) for p in batch]
    last = {i: hf_logits(hf_model, p)[-1] for i, p in enumerate(sequences)}
    for _ in range(6):
        new = {i: int(last[i].argmax()) for i in last}
        for i, token in new.items():
            sequences[i].append(token)
        outs = runner.step([(i, [new[i]]) for i in sorted(new)])
        for i, out in zip(sorted(new), outs):
            expected = hf_logits(hf_model, sequences[i])[-1]
            torch.testing.assert_close(out[0], expected, atol=1e-4, rtol=1e-4)
            last[i] = expected


def test_forward_returns_only_logits_indices(tmp_path):
    _, model_dir = hf_tiny("llama_gqa_tied", tmp_path)
    model, config = load_model(model_dir, torch.float32, "cpu")
    batch = [(0, [5, 6, 7, 8, 9]), (1, [3]), (2, [4, 4, 4, 4])]
    full = PagedRunner(model, config).step(batch)
    last = PagedRunner(model, config).step(batch, last_only=True)
    for f, l in zip(full, last):
        torch.testing.assert_close(l[0], f[-1], atol=1e-5, rtol=1e-5)


def test_load_weights_reports_missing_and_unexpected(tmp_path):
    _, model_dir = hf_tiny("llama_untied", tmp_path)
    config = ModelConfig.from_pretrained(model_dir)
    from worker_svc.weights import iter_weights

    weights = dict(iter_weights(model_dir))
    model = build_model(config, torch.float32, "cpu")
    broken = {k: v for k, v in weights.items() if k not in ("lm_head.weight", "model.layers.1.self_attn.k_proj.weight")}
    broken["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as info:
        model.load_weights(broken.items())
    message = str(info.value)
    assert "missing weights: lm_head.weight, model.layers.1.self_attn.k_proj.weight" in message
    assert "unexpected weights: model.layers.0.self_attn.extra.weight" in message
    # old-checkpoint buffers are skipped
    model.load_weights(list(weights.items()) + [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])


def test_gpt2_loads_unprefixed_checkpoint_names(tmp_path):
    hf_model, model_dir = hf_tiny("gpt2", tmp_path)
    from worker_svc.weights import iter_weights

    config = ModelConfig.from_pretrained(model_dir)
    model = build_model(config, torch.float32, "cpu")
    # the original OpenAI-converted checkpoints name weights without "transformer." and carry mask buffers
    weights = [(k.removeprefix("transformer."), v) for k, v in iter_weights(model_dir)]
    weights.append(("h.0.attn.bias", torch.ones(1, 1, 64, 64)))
    model.load_weights(weights)
    runner = PagedRunner(model, config)
    out = runner.step([(0, [3, 1, 4, 1, 5, 9])])[0]
    torch.testing.assert_close(out, hf_logits(hf_model, [3, 1, 4, 1, 5, 9]), atol=1e-4, rtol=1e-4)


def test_bfloat16_model_runs_close_to_fp32(tmp_path):
    _, model_dir = hf_tiny("llama_gqa_tied", tmp_path)
    model32, config = load_model(model_dir, torch.float32, "cpu")
    model16, _ = load_model(model_dir, torch.bfloat16, "cpu")
    assert model16.model.rotary_emb.cos_cache.dtype == torch.bfloat16
    tokens = [(0, [5, 6, 7, 8, 9, 10, 11])]
    out32 = PagedRunner(model32, config).step(tokens)[0]
    runner16 = PagedRunner(model16, config)
    runner16.cache = PagedKVCache(config.num_layers, 64, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.bfloat16, "cpu")
    out16 = runner16.step(tokens)[0]
    assert out16.dtype == torch.float32
    torch.testing.assert_close(out16, out32, atol=0.1, rtol=0.05)
