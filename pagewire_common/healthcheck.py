"""``python -m pagewire_common.healthcheck ADDR [SERVICE]``: exit 0 when the gRPC health service at
ADDR reports SERVING (used by docker compose)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(addr: str, service: str = "", timeout: float = 2.0) -> bool:
    try:
        with grpc.insecure_channel(addr) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 2
    return 0 if check(argv[0], argv[1] if len(argv) > 1 else "") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
