"""Generated gRPC stubs for ``protos/pagewire/v1``.

Import the modules from here (``from pagewire_common.v1 import generation_pb2``). If the stubs are
missing or older than their ``.proto`` files (a source checkout after a contract change),
they are regenerated on first import, so stale stubs never run.
"""

from pagewire_common import protogen as _protogen

if _protogen.is_stale():
    _protogen.generate()
