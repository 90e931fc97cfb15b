"""Generate the gRPC Python stubs from ``protos/`` (``python -m pagewire.protogen``).

The stubs are derived files and are not committed: ``make install`` generates them, and
importing ``pagewire.v1`` regenerates them when a ``.proto`` is newer than its stubs, so stale
stubs cannot run.
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # .../pagewire
PROTO_ROOT = PACKAGE_DIR.parent / "protos"
PROTO_FILES = ("pagewire/v1/generation.proto", "pagewire/v1/worker.proto")


def stub_paths(out_root: Path) -> list[Path]:
    paths = []
    for proto in PROTO_FILES:
        stem = out_root / proto.removesuffix(".proto")
        paths += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2_grpc.py")]
    return paths


def is_stale(out_root: Path = PACKAGE_DIR.parent) -> bool:
    if not PROTO_ROOT.is_dir():  # installed without sources: nothing to compare with
        return False
    newest_proto = max((PROTO_ROOT / p).stat().st_mtime for p in PROTO_FILES)
    stubs = stub_paths(out_root)
    return any(not s.exists() or s.stat().st_mtime < newest_proto for s in stubs)


def generate(out_root: Path = PACKAGE_DIR.parent) -> list[Path]:
    """Run protoc (from grpcio-tools) over ``protos/`` into ``out_root`` (the repository root
    by default, so the stubs land in ``pagewire/v1/``)."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(PROTO_ROOT / p) for p in PROTO_FILES),
    ]
    (out_root / "pagewire" / "v1").mkdir(parents=True, exist_ok=True)
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
    return stub_paths(out_root)


def main() -> int:
    for path in generate():
        print(f"generated {path.relative_to(PACKAGE_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
