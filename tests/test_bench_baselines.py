"""The hf-cb baseline on whichever transformers 5 is installed: our settings reach its continuous
batching under the names that version uses (``page_size`` from 5.18, ``block_size`` before, the
generation config before ``ContinuousBatchingConfig``), and a real run on a tiny model."""

from __future__ import annotations

import dataclasses

import pytest

from pagewire.bench.baselines import CB_NAMES, BaselineOptions, HFBaselines, cb_kwargs, parameter_names
from tests.tiny_models import get_tiny_model

SETTINGS = {"page_size": 16, "num_blocks": 7, "max_batch_tokens": 64, "max_requests_per_batch": 4,
            "allow_block_sharing": True, "seed": 0}


@dataclasses.dataclass
class ConfigUpTo517:
    """transformers 5.12-5.17's ContinuousBatchingConfig, cut down: the page size is `block_size`."""

    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True
    seed: int | None = None


@dataclasses.dataclass
class ConfigFrom518(ConfigUpTo517):
    """5.18 on: `page_size`, with `block_size` kept as a deprecated alias."""

    page_size: int = 256


@dataclasses.dataclass
class ConfigOf54:
    """5.4-5.8: no `max_requests_per_batch` nor `seed` yet."""

    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    allow_block_sharing: bool = True


def test_the_page_size_goes_under_the_name_the_config_has():
    assert cb_kwargs(SETTINGS, parameter_names(ConfigUpTo517)) == (
        {"block_size": 16, "num_blocks": 7, "max_batch_tokens": 64, "max_requests_per_batch": 4,
         "allow_block_sharing": True, "seed": 0}, [])
    kwargs, missing = cb_kwargs(SETTINGS, parameter_names(ConfigFrom518))
    assert kwargs["page_size"] == 16 and "block_size" not in kwargs and missing == []  # not the deprecated alias
    ConfigUpTo517(**cb_kwargs(SETTINGS, parameter_names(ConfigUpTo517))[0])  # it takes every one


def test_a_setting_the_config_has_no_field_for_is_left_out_and_named():
    kwargs, missing = cb_kwargs(SETTINGS, parameter_names(ConfigOf54))
    assert kwargs == {"block_size": 16, "num_blocks": 7, "max_batch_tokens": 64, "allow_block_sharing": True}
    assert missing == ["max_requests_per_batch", "seed"]
    assert ConfigOf54(**kwargs).block_size == 16


def test_parameter_names_of_a_plain_class_come_from_its_signature():
    class Plain:
        def __init__(self, block_size=256, num_blocks=None, **extra):
            pass

    assert parameter_names(Plain) == {"block_size", "num_blocks", "extra"}
    assert cb_kwargs({"page_size": 8, "seed": 1}, parameter_names(Plain)) == ({"block_size": 8}, ["seed"])


@pytest.fixture(scope="module")
def hf():
    return HFBaselines(BaselineOptions(
        model_dir=get_tiny_model("llama-gqa"), max_new_tokens=6, ignore_eos=True, block_size=16,
        max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64,
    ))


def test_cb_setup_follows_the_installed_config_class(hf, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", ConfigOf54, raising=False)
    setup = hf.cb_setup(max_seq_len=32, max_running=4)  # 9 blocks: 2 of 16 tokens for each of 4, and 1
    assert setup.config == ConfigOf54(block_size=16, num_blocks=9, max_batch_tokens=64, allow_block_sharing=True)
    assert setup.context_kwargs["continuous_batching_config"] is setup.config and setup.generation_attrs == {}
    assert setup.applied == {"page_size": 16, "num_blocks": 9, "max_batch_tokens": 64, "allow_block_sharing": True}
    assert setup.unsupported == ["max_requests_per_batch", "seed"]


def test_cb_setup_before_the_config_class_uses_the_generation_config(hf, monkeypatch):
    import transformers

    def context_manager_of_51(generation_config=None, manual_eviction=False, max_queue_size=0, num_q_cuda_graphs=0,
                              num_kv_cuda_graphs=0, allow_block_sharing=True, block=True, timeout=None):
        raise AssertionError("not called")

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", None, raising=False)
    monkeypatch.setattr(hf.model, "continuous_batching_context_manager", context_manager_of_51)
    setup = hf.cb_setup(max_seq_len=32, max_running=4, workload_hints=object())
    assert setup.config is None
    assert setup.generation_attrs == {"block_size": 16, "num_blocks": 9, "max_batch_tokens": 64}
    assert setup.context_kwargs == {"allow_block_sharing": True}  # no workload hints: it takes none
    assert setup.unsupported == ["max_requests_per_batch", "seed"]


@pytest.mark.parametrize("mode", ["concurrency", "arrivals"])
def test_hf_cb_runs_on_the_installed_transformers(hf, mode):
    prompts = [[5, 6, 7, 8, 9], list(range(20, 37)), [42], [3, 4], list(range(50, 60))]
    if mode == "concurrency":
        records, duration = hf.run_continuous(prompts, concurrency=3)
    else:
        records, duration = hf.run_continuous(prompts, arrival_offsets=[0.0, 0.0, 0.01, 0.02, 0.02])
    assert [(r.error, r.completion_tokens, r.prompt_tokens) for r in records] == [(None, 6, len(p)) for p in prompts]
    for r in records:
        assert len(r.arrival_times) == 6 and r.arrival_counts == [1] * 6  # a time for every token, no more
        assert r.send_time <= r.arrival_times[0] and r.arrival_times == sorted(r.arrival_times)
        assert r.arrival_times[-1] <= r.end_time
    assert duration > 0
    setup = hf.last_cb_setup
    assert set(setup.applied) | set(setup.unsupported) == set(CB_NAMES)
    assert setup.applied["page_size"] == 16 and setup.applied["max_batch_tokens"] == 64
