"""A small client for the Generation service, and ``pagewire generate``."""

from __future__ import annotations

import sys

import grpc

from pagewire_common.sampling import DEFAULT_SAMPLING as _DEFAULT
from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc


def make_sampling(max_tokens=_DEFAULT.max_tokens, temperature=0.0, top_p=None, top_k=_DEFAULT.top_k, seed=None,
                  stop=_DEFAULT.stop, stop_token_ids=_DEFAULT.stop_token_ids, ignore_eos=_DEFAULT.ignore_eos,
                  logprobs=_DEFAULT.logprobs) -> pb.SamplingParams:
    """A ``SamplingParams`` message: greedy unless told otherwise, every other field as
    ``SamplingParams`` declares it (``top_p`` and ``seed`` None: left unset)."""
    msg = pb.SamplingParams(temperature=temperature, top_k=top_k, max_tokens=max_tokens, stop=list(stop),
                            stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, logprobs=logprobs)
    if top_p is not None:
        msg.top_p = top_p
    if seed is not None:
        msg.seed = seed
    return msg


def open_channel(addr: str, *, tls: bool = False, tls_ca_file: str | None = None, options=None) -> grpc.Channel:
    """A channel to a pagewire server: plaintext, or TLS (``tls``: trusting the system's CAs;
    ``tls_ca_file``: trusting the PEM certificates in that file, e.g. a self-signed one)."""
    if not tls and tls_ca_file is None:
        return grpc.insecure_channel(addr, options=options)
    roots = None
    if tls_ca_file is not None:
        with open(tls_ca_file, "rb") as f:
            roots = f.read()
    return grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=roots), options=options)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries an API key (``--api-key`` on the server)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def generate_command(args) -> int:
    sampling = make_sampling(args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed, args.stop,
                             ignore_eos=args.ignore_eos)
    metadata = auth_metadata(args.api_key)
    with open_channel(args.addr, tls=args.tls, tls_ca_file=args.tls_ca_file) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        if args.chat:
            messages = []
            if args.system:
                messages.append(pb.ChatMessage(role="system", content=args.system))
            messages.append(pb.ChatMessage(role="user", content=args.prompt))
            call = stub.Chat(pb.ChatRequest(messages=messages, sampling=sampling), timeout=args.timeout,
                             metadata=metadata)
        else:
            call = stub.Generate(pb.GenerateRequest(prompt=args.prompt, sampling=sampling), timeout=args.timeout,
                                 metadata=metadata)
        last = None
        try:
            for resp in call:
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
        except grpc.RpcError as e:
            print(f"\npagewire: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if args.show_usage and last is not None:
        u = last.usage
        print(
            f"[{pb.FinishReason.Name(last.finish_reason).lower()}] prompt {u.prompt_tokens} tokens "
            f"({u.cached_prompt_tokens} cached), completion {u.completion_tokens} tokens",
            file=sys.stderr,
        )
    return 0
