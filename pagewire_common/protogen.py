"""Generate the gRPC Python stubs from ``protos/`` (``python -m pagewire_common.protogen``).

The stubs are derived files and are not committed: ``make protos`` (which ``make serve`` and
``make test`` run) generates them, and importing ``pagewire_common.v1`` regenerates them when a
``.proto`` is newer than its stubs, so stale stubs cannot run. The proto package is
``pagewire.v1`` (the wire contract); the Python modules live in ``pagewire_common/v1/``, the
torch-free floor every layer may import, so the imports protoc writes between the stubs
(``from pagewire.v1 import ...``) are rewritten to it.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # .../pagewire_common
PROTO_ROOT = PACKAGE_DIR.parent / "protos"
PROTO_FILES = ("pagewire/v1/generation.proto", "pagewire/v1/link.proto", "pagewire/v1/worker.proto",
               "pagewire/v1/core.proto")
_IMPORT = re.compile(r"^from pagewire\.v1 import", re.MULTILINE)


def stub_paths(out_dir: Path) -> list[Path]:
    paths = []
    for proto in PROTO_FILES:
        stem = out_dir / Path(proto).stem
        paths += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return paths


def is_stale(out_dir: Path = PACKAGE_DIR / "v1") -> bool:
    if not PROTO_ROOT.is_dir():  # installed without sources: nothing to compare with
        return False
    newest_proto = max((PROTO_ROOT / p).stat().st_mtime for p in PROTO_FILES)
    return any(not s.exists() or s.stat().st_mtime < newest_proto for s in stub_paths(out_dir))


def generate(out_dir: Path = PACKAGE_DIR / "v1") -> list[Path]:
    """Run protoc (from grpcio-tools) over ``protos/`` and write the stubs into ``out_dir``
    (``pagewire_common/v1/`` by default)."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagewire-protoc-") as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_ROOT / p) for p in PROTO_FILES),
        ]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
        for path in stub_paths(out_dir):
            text = (Path(tmp) / "pagewire" / "v1" / path.name).read_text()
            path.write_text(_IMPORT.sub("from pagewire_common.v1 import", text))
    return stub_paths(out_dir)


def main() -> int:
    for path in generate():
        print(f"generated {path.relative_to(PACKAGE_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
