"""A small client for the Generation service, and ``pagewire generate``."""

from __future__ import annotations

import os
import ssl
import sys
from dataclasses import dataclass

import grpc

from pagewire_common.sampling import DEFAULT_SAMPLING as _DEFAULT
from pagewire_common.sampling import SamplingParams
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


@dataclass(frozen=True)
class ServerAccess:
    """How a client reaches a server started with ``--api-key`` or TLS (``pagewire generate``'s and
    ``pagewire bench``'s connection flags): the key it sends, and TLS trusting the system's CAs
    (``tls``) or the PEM certificates in ``tls_ca_file`` (a private CA, a self-signed certificate)."""

    api_key: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None

    @classmethod
    def from_args(cls, args) -> ServerAccess:
        return cls(args.api_key, args.tls, args.tls_ca_file)

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.tls_ca_file is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries the key."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        """gRPC's channel credentials, None for plaintext."""
        if not self.uses_tls:
            return None
        roots = None
        if self.tls_ca_file is not None:
            with open(self.tls_ca_file, "rb") as f:
                roots = f.read()
        return grpc.ssl_channel_credentials(root_certificates=roots)

    def http_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def ssl_context(self) -> ssl.SSLContext | None:
        """For an HTTPS client: None for plaintext."""
        return ssl.create_default_context(cafile=self.tls_ca_file) if self.uses_tls else None


def open_channel(addr: str, access: ServerAccess = ServerAccess(), options=None) -> grpc.Channel:
    """A channel to a pagewire server, plaintext or TLS as ``access`` says."""
    credentials = access.credentials()
    if credentials is None:
        return grpc.insecure_channel(addr, options=options)
    return grpc.secure_channel(addr, credentials, options=options)


def generate_command(args) -> int:
    if args.system is not None and not args.chat:
        print("pagewire: error: --system goes with --chat (a plain prompt has no system message)", file=sys.stderr)
        return 2
    try:  # the values checked here as the server checks them, named, before anything is sent
        checked = SamplingParams(temperature=args.temperature, top_p=_DEFAULT.top_p if args.top_p is None else args.top_p,
                                 top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
    except ValueError as e:
        print(f"pagewire: error: {e}", file=sys.stderr)
        return 2
    sampling = make_sampling(args.max_tokens, args.temperature, args.top_p, checked.top_k, args.seed, args.stop,
                             ignore_eos=args.ignore_eos)
    try:
        return _generate(args, sampling)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _generate(args, sampling: pb.SamplingParams) -> int:
    access = ServerAccess.from_args(args)
    metadata = access.metadata()
    with open_channel(args.addr, access) as channel:
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
