"""``python -m pagewire_common.healthcheck ADDR [SERVICE] [--tls-ca-file PATH]``: exit 0 when the
gRPC health service at ADDR reports SERVING (used by docker compose). Health needs no API key;
``--tls-ca-file`` checks a server started with ``--tls-cert-file``, trusting the PEM
certificate(s) in PATH."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(addr: str, service: str = "", timeout: float = 2.0, tls_ca_file: str | None = None) -> bool:
    try:
        if tls_ca_file is None:
            channel = grpc.insecure_channel(addr)
        else:
            with open(tls_ca_file, "rb") as f:
                channel = grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=f.read()))
        with channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except (grpc.RpcError, OSError):
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    tls_ca_file = None
    if "--tls-ca-file" in argv:
        i = argv.index("--tls-ca-file")
        if i + 1 >= len(argv):
            print(__doc__.strip())
            return 2
        tls_ca_file = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 2
    return 0 if check(argv[0], argv[1] if len(argv) > 1 else "", tls_ca_file=tls_ca_file) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
