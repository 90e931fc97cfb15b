"""A step's arrays between host and device: all inputs in one host-to-device copy, and the
sampled tokens back without stopping the host.

``HostToDevice.stage`` writes every host array of a step (token ids, positions, slots, lengths,
rows, ...) at its own 64-byte-aligned offset of one pinned buffer and copies the used bytes with
one non-blocking copy; each array comes back as a view of the device buffer with its own dtype.
A destination may be given (the CUDA graphs' static inputs live at fixed offsets of one device
buffer, so their step inputs land in place). The pinned buffers alternate between two, so a step
never writes the one whose copy the step before may still be reading; before a buffer is written
again, the copy recorded on it two steps earlier is waited for (long done in practice).

On CPU nothing is copied: an array becomes a tensor over its memory (or is written into the
destination given); another device gets a plain copy per array.

``DeviceToHost`` starts the copies of a step's sampled tokens (and logprobs when asked) to the
host and records an event after them; ``ready`` polls it and ``wait`` blocks on it. A
``LaunchedStep`` holds them until the runner finishes the step, and ``fill_sampled`` writes them
into its result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagewire_common.plan import StepResult

if TYPE_CHECKING:
    from worker_svc.plan_state import SeqState

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_ITEMSIZE = {dtype: np.dtype(np_type).itemsize for dtype, np_type in _NUMPY.items()}


# every section starts on a multiple of this many bytes: Triton compiles a kernel variant per
# argument pointer that is, or is not, 16-byte aligned (its divisibility specialization), and the
# worker compiles the aligned ones at start; one misaligned view would compile mid-serving
ALIGN = 64


def aligned(offset: int) -> int:
    """``offset`` rounded up to a multiple of ``ALIGN``."""
    return -(-offset // ALIGN) * ALIGN


@dataclass(slots=True)
class Section:
    """One array of a step's inputs: ``array`` (1-D or 2-D) as ``dtype`` at byte ``offset`` of the
    staging buffer (None: after the previous section)."""

    array: np.ndarray
    dtype: torch.dtype
    offset: int | None = None


def layout(sections: list[Section], start: int = 0) -> int:
    """Give every section without an offset one after the previous (``ALIGN``-byte aligned);
    returns the end of the last."""
    end = start
    for s in sections:
        if s.offset is None:
            s.offset = aligned(end)
        end = max(end, s.offset + s.array.size * _ITEMSIZE[s.dtype])
    return end


class HostToDevice:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._pinned: list[torch.Tensor | None] = [None, None]  # uint8, alternating per step
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._device_buf: torch.Tensor | None = None  # uint8 on the device, for stages without a destination

    def stage(self, sections: list[Section], dest: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each section's array as a ``dtype`` tensor on the device (in ``dest``, a uint8 device
        tensor, when given; its sections' offsets are then fixed by the caller)."""
        end = layout(sections)
        if not self._cuda:
            return [self._direct(s, dest) for s in sections]
        turn = self._turn
        self._turn ^= 1
        pinned = self._pinned[turn]
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy made from this buffer two steps ago
        if pinned is None or pinned.numel() < end:
            pinned = self._pinned[turn] = torch.empty(max(end, 4096) * 2, dtype=torch.uint8, pin_memory=True)
        host = pinned.numpy()
        for s in sections:
            n = s.array.size * _ITEMSIZE[s.dtype]
            host[s.offset : s.offset + n].view(_NUMPY[s.dtype])[:] = s.array.reshape(-1)
        if dest is None:
            if self._device_buf is None or self._device_buf.numel() < end:
                self._device_buf = torch.empty(max(end, 4096) * 2, dtype=torch.uint8, device=self.device)
            dest = self._device_buf
        dest[:end].copy_(pinned[:end], non_blocking=True)
        event = self._copied[turn]
        if event is None:
            event = self._copied[turn] = torch.cuda.Event()
        event.record()
        return [_view(dest, s) for s in sections]

    def _direct(self, s: Section, dest: torch.Tensor | None) -> torch.Tensor:
        if dest is None:
            t = torch.from_numpy(np.ascontiguousarray(s.array))
            return t.to(self.device, s.dtype)  # no copy on CPU where the dtype is the array's
        out = _view(dest, s)
        if out.device.type == "cpu":
            out.numpy()[...] = s.array
        else:
            out.copy_(torch.from_numpy(np.ascontiguousarray(s.array)))
        return out


def _view(buf: torch.Tensor, s: Section) -> torch.Tensor:
    n = s.array.size * _ITEMSIZE[s.dtype]
    return buf[s.offset : s.offset + n].view(s.dtype).view(s.array.shape)


@dataclass(slots=True)
class DeviceToHost:
    """Host copies of a step's outputs, complete once ``ready``."""

    tensors: list[torch.Tensor]
    event: torch.cuda.Event | None

    @classmethod
    def start(cls, tensors: list[torch.Tensor]) -> DeviceToHost:
        if not tensors or tensors[0].device.type != "cuda":
            return cls([t.cpu() for t in tensors], None)
        # non_blocking to the host allocates pinned memory: the copy runs behind the queued work
        host = [t.to("cpu", non_blocking=True) for t in tensors]
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> list[torch.Tensor]:
        event = self.event  # (a waiting thread and the step's finish may both be here)
        if event is not None:
            event.synchronize()
            self.event = None
        return self.tensors


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued on the device. ``ModelRunner.finish`` completes its result:
    at once for a step that waited for its tokens, else once the tokens reach the host."""

    result: StepResult
    # a step launched ahead: the sequences that sampled, each one's placeholder index in its
    # token_ids, and the host copies of tokens [, logprobs] [, top ids, top logprobs]
    states: list[SeqState] | None = None
    slots: list[int] | None = None
    outputs: DeviceToHost | None = None
    params: list | None = None
    want_logprobs: bool = False
    num_top: int = 0

    def ready(self) -> bool:
        """Whether ``finish`` would not wait for the device."""
        return self.outputs is None or self.outputs.ready()

    def wait(self) -> None:
        if self.outputs is not None:
            self.outputs.wait()


def fill_sampled(result: StepResult, token_list: list[int], logprobs: list[float] | None, params, num_top: int,
                  top: list[torch.Tensor] | None) -> None:
    """``result``'s sampled fields from the step's host copies (logprobs NaN for a row that did
    not ask)."""
    result.token_ids = token_list
    if logprobs is not None:
        result.logprobs = [lp if p.logprobs else float("nan") for lp, p in zip(logprobs, params)]
    if num_top:
        top_ids, top_logprobs = top
        result.num_top_logprobs = num_top
        result.top_token_ids = top_ids.flatten().tolist()
        result.top_logprobs = top_logprobs.flatten().tolist()
