"""The public gRPC stubs for clients: ``from pagewire.v1 import generation_pb2, generation_pb2_grpc``.

They are generated from ``protos/pagewire/v1/generation.proto`` into ``pagewire_common.v1``.
"""

from pagewire_common.v1 import generation_pb2, generation_pb2_grpc

__all__ = ["generation_pb2", "generation_pb2_grpc"]
