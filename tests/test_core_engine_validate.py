"""``EngineCore.validate(decoded=True)``: the core's add path takes the ids CoreRequests decoded as
they are, and still refuses what the plain path refuses."""

from __future__ import annotations

import pytest

from pagewire_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.engine import EngineCore, WorkerInfo


def make_engine() -> EngineCore:
    return EngineCore(SchedulerConfig(max_model_len=64, max_num_seqs=4), WorkerInfo("m", 100, 64, 4, 64, (2,)))


def test_decoded_ids_are_taken_as_they_are() -> None:
    engine = make_engine()
    ids = [5, 6, 7]
    assert engine.validate(ids, SamplingParams(max_tokens=4), decoded=True) is ids
    converted = engine.validate(ids, SamplingParams(max_tokens=4))
    assert converted == ids and converted is not ids


@pytest.mark.parametrize("ids, message", [([5, 100], "outside the vocabulary"), ([], "empty"),
                                          (list(range(1, 65)), "maximum model length")])
def test_decoded_ids_are_still_checked(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine().validate(ids, SamplingParams(max_tokens=1), strict_length=True, decoded=True)
