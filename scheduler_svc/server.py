"""The public ``pagewire.v1.Generation`` service (grpc.aio) in front of the engine thread."""

from __future__ import annotations

import logging
import uuid

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagewire_common import wire
from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc
from scheduler_svc.engine import RequestOutput
from scheduler_svc.engine_loop import EngineService, NotReadyError, OutputStream, QueueFullError, WorkerLost
from scheduler_svc.sequence import FinishReason

log = logging.getLogger("pagewire.scheduler")

SERVICE_NAME = "pagewire.v1.Generation"
_FINISH = {None: pb.UNSPECIFIED, FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, service: EngineService):
        self.service = service
        self.num_rejected = 0
        self.draining = False

    # ---- RPCs -----------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        prompt = request.prompt if request.prompt else None
        ids = list(request.prompt_token_ids) if len(request.prompt_token_ids) else None
        if prompt is None and ids is None:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "give a prompt or prompt_token_ids (both are empty)")
        async for resp in self._run(request.request_id, prompt, ids, request.sampling, request.model, context):
            yield resp

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext):
        tokenizer = self.service.tokenizer
        if not request.messages:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "messages is empty")
        if tokenizer is None:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "the worker is not connected")
        try:
            prompt = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in request.messages])
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async for resp in self._run(request.request_id, prompt, None, request.sampling, request.model, context):
            yield resp

    async def GetModelInfo(self, request, context):
        info = self.service.worker_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is not connected yet")
        engine = self.service.engine
        return pb.ModelInfo(
            model_name=info.model_name,
            max_model_len=engine.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            eos_token_ids=list(info.eos_token_ids),
            dtype=info.dtype,
            device=info.device,
            has_chat_template=bool(self.service.tokenizer and self.service.tokenizer.chat_template),
        )

    async def GetStats(self, request, context):
        return pb.Stats(num_requests_rejected=self.num_rejected, **self.service.stats())

    # ---- one request ------------------------------------------------------------------------

    async def _reject(self, context, code: grpc.StatusCode, message: str):
        self.num_rejected += 1
        await context.abort(code, message)

    async def _run(self, request_id, prompt, ids, sampling_msg, model, context):
        service = self.service
        if self.draining:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if model and service.worker_info is not None and model != service.worker_info.model_name:
            await self._reject(
                context, grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown model {model!r}; this server serves {service.worker_info.model_name!r}",
            )
        try:
            sampling = wire.sampling_from_pb(sampling_msg)
            token_ids = service.validate(prompt, ids, sampling)
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NotReadyError as e:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, str(e))
        request_id = request_id or uuid.uuid4().hex
        outputs = OutputStream()
        try:
            service.submit(request_id, token_ids, sampling, outputs)
        except QueueFullError as e:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NotReadyError as e:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS, str(e))
        finished = False
        try:
            while not finished:
                # deltas that piled up while this stream was being written go out as one message
                items = await outputs.take()
                last = items[-1]
                if isinstance(last, WorkerLost):  # always the last item: nothing follows it
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, last.message)
                finished = last.finished
                yield _response(request_id, items)
        finally:
            if not finished:  # cancelled, deadline passed, or the client went away
                service.abort(request_id)


def _response(request_id: str, items: list[RequestOutput]) -> pb.GenerateResponse:
    last = items[-1]
    resp = pb.GenerateResponse(
        request_id=request_id,
        token_ids=[t for it in items for t in it.token_ids],
        text="".join(it.text for it in items),
        finish_reason=_FINISH[last.finish_reason],
    )
    if last.logprobs is not None:
        resp.logprobs.extend(lp for it in items for lp in (it.logprobs or ()))
    if last.usage is not None:
        u = last.usage
        resp.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
            )
        )
    return resp


async def build_server(service: EngineService, listen: str):
    """A started grpc.aio server with Generation, health and reflection; returns
    (server, port, servicer, health servicer)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
        ]
    )
    servicer = GenerationServicer(service)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(listen)
    if port == 0 and not listen.startswith("unix:"):
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    return server, port, servicer, health_servicer
