"""From sampled tokens to what a client sees: incremental text, stop strings, stream interval.

One ``TextStream`` per request (per sample when n > 1), fed the request's tokens as they come from
the engine core, as ``CoreOutputs`` (an API server receives them from the core process;
``pagewire.LLM`` builds them from the engine in the same process, with the same ``deliver``). It detokenizes incrementally, finds stop strings (the caller then ends the request
in the core: a token computed past a stop is never streamed or counted), and applies
``stream_interval``: after the first token, a delta goes out once that many tokens are ready or
the request ends. Requests with stop strings are detokenized token by token, so a stop is found
at once; the others only when a delta goes out.
"""

from __future__ import annotations

from pagewire_common.core_messages import CoreOutputs
from pagewire_common.requests import FinishReason, PromptLogprobs, TextDelta, Usage
from pagewire_common.sampling import SamplingParams
from pagewire_common.settings import default_of
from scheduler_svc.api.stop_strings import StopStrings
from scheduler_svc.api.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "want_logprobs", "logprobs", "detokenizer",
        "detokenize_each_token", "num_streamed_tokens", "held_text", "finish_reason", "num_cached_prompt_tokens",
        "stream_interval", "want_top_logprobs", "top_logprobs", "index", "n", "prompt_logprobs", "plain",
        "min_tokens",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 tokenizer: Tokenizer | None, stream_interval: int = default_of("stream_interval"),
                 index: int = 0, stop_strings: StopStrings | None = None):
        """``stop_strings``: the automaton of ``sampling.stop``, shared by the request's samples
        (built here when not given)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)  # prompt + output: the detokenizer reads both
        self.num_prompt_tokens = len(prompt_token_ids)
        self.want_logprobs = sampling.logprobs
        self.logprobs: list[float] = []
        self.want_top_logprobs = sampling.top_logprobs
        self.top_logprobs: list[tuple[list[int], list[float]]] = []
        self.index = index  # which of the request's n samples
        self.n = sampling.n
        self.detokenizer = (
            IncrementalDetokenizer.for_prompt(tokenizer, self.num_prompt_tokens, sampling.stop, stop_strings,
                                              sampling.include_stop_str_in_output)
            if tokenizer is not None else None
        )
        self.detokenize_each_token = self.detokenizer is not None and bool(sampling.stop)
        self.min_tokens = sampling.min_tokens  # stop strings end the stream from this many output tokens on
        self.num_streamed_tokens = 0
        self.held_text = ""  # text decoded token by token and not yet in a delta
        self.finish_reason: FinishReason | None = None
        self.num_cached_prompt_tokens = 0
        self.stream_interval = stream_interval
        self.prompt_logprobs: PromptLogprobs | None = None  # from the core, until the first delta takes them
        # the common stream: each token goes out at once as a delta of its text and nothing else
        # (``OutputProcessor.apply`` takes a shorter path for it)
        self.plain = (self.detokenizer is not None and self.detokenizer.one_token_at_a_time and stream_interval == 1
                      and not self.want_logprobs and not self.want_top_logprobs)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token_id: int, logprob: float | None = None,
                  top: tuple[list[int], list[float]] | None = None) -> bool:
        """Append one sampled token (with its top logprobs when asked). Returns True when it
        completed a stop string: the stream is then finished (STOP) and the caller must end the
        request in the core."""
        if self.finish_reason is not None:
            return False  # computed past the end: never streamed or counted
        self.token_ids.append(token_id)
        if self.want_logprobs:
            self.logprobs.append(float("nan") if logprob is None else logprob)
        if self.want_top_logprobs:
            self.top_logprobs.append(top if top is not None else ([], []))
        if self.detokenize_each_token:
            detok = self.detokenizer
            self.held_text += detok.update(self.token_ids, is_final=False,
                                           may_stop=self.num_output_tokens >= self.min_tokens)
            if detok.stopped:
                self.finish_reason = FinishReason.STOP
                return True
        return False

    def finish(self, reason: FinishReason) -> None:
        """The core ended the request (EOS, stop token id, max_tokens, model length)."""
        if self.finish_reason is None:
            self.finish_reason = reason
            if self.detokenize_each_token:
                self.held_text += self.detokenizer.update(self.token_ids, is_final=True,
                                                          may_stop=self.num_output_tokens >= self.min_tokens)

    def ready(self) -> bool:
        """Whether a delta should go out now (first token, end, or ``stream_interval`` tokens)."""
        pending = self.num_output_tokens - self.num_streamed_tokens
        if self.finish_reason is not None:
            return True
        return pending > 0 and (not self.num_streamed_tokens or pending >= self.stream_interval)

    def take(self) -> TextDelta:
        """The delta since the last one (text detokenized now if not token by token)."""
        start = self.num_prompt_tokens + self.num_streamed_tokens
        new_ids = self.token_ids[start:]
        new_logprobs = self.logprobs[self.num_streamed_tokens:] if self.want_logprobs else None
        self.num_streamed_tokens += len(new_ids)
        is_final = self.finish_reason is not None
        if self.detokenize_each_token:
            text, self.held_text = self.held_text, ""
        elif self.detokenizer is not None:
            text = self.detokenizer.update(self.token_ids, is_final=is_final)
        else:
            text = ""
        out = TextDelta(self.request_id, new_ids, text, self.finish_reason, new_logprobs, index=self.index)
        if self.want_top_logprobs:
            out.top_logprobs = self.top_logprobs[start - self.num_prompt_tokens:]
        if self.prompt_logprobs is not None:
            out.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        if is_final:
            out.usage = Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_prompt_tokens)
        return out


class OutputProcessor:
    """The ``TextStream`` of every request (sample) in flight, by request id, fed the core's
    ``CoreOutputs``: the API servers and the offline ``LLM`` turn tokens into deltas here."""

    def __init__(self, tokenizer: Tokenizer | None, stream_interval: int = default_of("stream_interval")):
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.streams: dict[int, TextStream] = {}

    def add(self, request_id: int, name: str, prompt_token_ids: list[int], sampling: SamplingParams) -> list[TextStream]:
        """Streams for a request and its samples (ids ``request_id`` .. ``request_id + n - 1``);
        ``name`` is the request id its caller shows the client."""
        streams = []
        # one automaton per request: each sample walks it with its own matcher
        stop_strings = StopStrings(sampling.stop) if sampling.stop and self.tokenizer is not None else None
        for index in range(sampling.n):
            stream = TextStream(name, prompt_token_ids, sampling, self.tokenizer, self.stream_interval, index,
                                stop_strings)
            self.streams[request_id + index] = stream
            streams.append(stream)
        return streams

    def remove(self, request_id: int) -> None:
        self.streams.pop(request_id, None)

    def apply(self, outputs: CoreOutputs) -> tuple[list[tuple[int, TextDelta]], list[int]]:
        """Apply one step's tokens from the core. Returns the deltas due now, by request id (a
        finished stream is removed), and the ids of the requests that hit a stop string (end them
        in the core). Tokens of a request no longer here (ended by a stop string, or its client
        left) are never streamed or counted."""
        streams = self.streams
        for request_id, cached in zip(outputs.started_ids, outputs.num_cached_prompt_tokens):
            stream = streams.get(request_id)
            if stream is not None:
                stream.num_cached_prompt_tokens = cached
        for request_id, prompt_logprobs in zip(outputs.prompt_logprob_ids, outputs.prompt_logprobs):
            stream = streams.get(request_id)
            if stream is not None:
                stream.prompt_logprobs = prompt_logprobs
        touched: dict[int, TextStream] = {}
        stopped: list[int] = []
        ready: list[tuple[int, TextDelta]] = []
        if len(outputs.request_ids):
            finishing = set(outputs.finished_ids) if outputs.finished_ids else ()
            ids = outputs.request_ids.tolist()
            tokens = outputs.token_ids.tolist()
            logprobs = outputs.logprobs.tolist() if outputs.logprobs is not None else None
            top_ids = top_lps = None
            if outputs.top_token_ids is not None:
                top_ids, top_lps = outputs.top_token_ids.tolist(), outputs.top_logprobs.tolist()
            for i, request_id in enumerate(ids):
                stream = streams.get(request_id)
                if stream is None:
                    continue
                if stream.plain and stream.prompt_logprobs is None and stream.finish_reason is None \
                        and request_id not in finishing:
                    # what add_token, ready and take do for it, without the generality
                    token = tokens[i]
                    stream.token_ids.append(token)
                    stream.num_streamed_tokens += 1
                    ready.append((request_id, TextDelta(stream.request_id, [token], stream.detokenizer.next_text(token),
                                                        index=stream.index)))
                    continue
                top = None
                if top_ids is not None and stream.want_top_logprobs:
                    k = stream.want_top_logprobs
                    top = (top_ids[i][:k], top_lps[i][:k])
                if stream.add_token(tokens[i], logprobs[i] if logprobs is not None else None, top):
                    stopped.append(request_id)
                touched[request_id] = stream
        for request_id, reason in zip(outputs.finished_ids, outputs.finish_reasons):
            stream = streams.get(request_id)
            if stream is not None:
                stream.finish(reason)
                touched[request_id] = stream
        for request_id, stream in touched.items():
            if stream.ready():
                ready.append((request_id, stream.take()))
                if stream.finished:
                    del streams[request_id]
        return ready, stopped
