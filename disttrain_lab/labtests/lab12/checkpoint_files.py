"""A DCP checkpoint's files as data: read without running what they hold, written by the grader.

``torch.distributed.checkpoint``'s own reader unpickles ``.metadata`` with ``pickle.load`` and the values
that are not tensors with ``torch.load(weights_only=False)``: files written by a student's ranks would
run code in the grader kernel.  :func:`read_checkpoint` reads the same format with an unpickler that
builds only DCP's metadata classes, torch's sizes and dtypes (anything else is refused, by name), and
every stored piece with ``torch.load(weights_only=True)``; the pieces of each tensor are put together
whole, and every element must come from one.

The files travel as data: ``{name relative to the checkpoint: bytes}``, from and to each process's
fsspec memory file system (``memory://``), where a graded rank writes its checkpoint, so that no file
is left on any disk.
"""

from __future__ import annotations

import io
import pickle
import warnings

import torch

__all__ = [
    "CheckpointUnreadable",
    "clear_memory_files",
    "files_holding",
    "memory_files",
    "put_memory_files",
    "read_checkpoint",
    "write_checkpoint",
]

MAX_BYTES = 16 << 20  # a checkpoint of the lab's MLP is about 60 KB
MAX_ELEMENTS = 1 << 20  # per tensor
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
}


class CheckpointUnreadable(AssertionError):
    """The files are not a checkpoint :func:`read_checkpoint` can read: what is wrong, named."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointUnreadable(
            f".metadata asks for {module}.{name}, which a checkpoint's metadata never holds "
            "(only DCP's metadata classes, torch.Size and dtypes are built)"
        )


def _piece(files: dict[str, bytes], info, what: str):
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors:
        raise CheckpointUnreadable(f"{what} is stored transformed ({descriptors}): save without extensions")
    data = files.get(info.relative_path)
    if data is None or not 0 <= info.offset <= info.offset + info.length <= len(data):
        raise CheckpointUnreadable(
            f"{what} lies at bytes {info.offset}–{info.offset + info.length} of {info.relative_path!r}, "
            f"which {'is missing' if data is None else f'holds {len(data)} bytes'}"
        )
    try:
        return torch.load(io.BytesIO(data[info.offset : info.offset + info.length]), weights_only=True)
    except Exception as exc:  # noqa: BLE001  (any unreadable piece is the same verdict)
        raise CheckpointUnreadable(f"{what} could not be read with torch.load(weights_only=True): {exc}") from None


def _metadata(files: dict[str, bytes]) -> tuple[dict, dict]:
    """``.metadata``'s storage (where each piece lies) and entries (each value's size and chunks), read with the
    unpickler that builds only DCP's classes."""
    if sum(len(v) for v in files.values()) > MAX_BYTES:
        raise CheckpointUnreadable(f"the checkpoint holds more than {MAX_BYTES:,} bytes")
    if ".metadata" not in files:
        raise CheckpointUnreadable(f"no .metadata among the checkpoint's files {sorted(files)[:6]}")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(files[".metadata"])).load()
    except CheckpointUnreadable:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointUnreadable(f".metadata could not be read: {type(exc).__name__}: {exc}") from None
    storage = getattr(metadata, "storage_data", None)
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(storage, dict) or not isinstance(entries, dict):
        raise CheckpointUnreadable(".metadata is not DCP's Metadata")
    return storage, entries


def files_holding(files: dict[str, bytes], prefix: str) -> set[str]:
    """The files (names relative to the checkpoint) that hold a piece of a tensor whose name starts with ``prefix``
    (``"model."``), by ``.metadata``: where a collective save put each rank's shard."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    storage, entries = _metadata(files)
    held = set()
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata) and fqn.startswith(prefix):
            for chunk in entry.chunks:
                info = storage.get(MetadataIndex(fqn, chunk.offsets))
                if info is not None:
                    held.add(str(info.relative_path))
    return held


def read_checkpoint(files: dict[str, bytes]) -> dict[str, object]:
    """The checkpoint's values by DCP's flattened names (``"model.0.weight"``, ``"optim.state.0.weight.exp_avg"``,
    ``"step"``): each tensor whole, each other value as ``torch.load(weights_only=True)`` gives it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    storage, entries = _metadata(files)
    values: dict[str, object] = {}
    for fqn, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata):
            values[fqn] = _piece(files, storage[MetadataIndex(fqn)], repr(fqn))
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointUnreadable(f"{fqn!r} is stored as {type(entry).__name__}")
        size = tuple(entry.size)
        if torch.Size(size).numel() > MAX_ELEMENTS:
            raise CheckpointUnreadable(f"{fqn!r} claims {size}: more than {MAX_ELEMENTS:,} elements")
        whole = torch.zeros(size, dtype=entry.properties.dtype)
        covered = torch.zeros(size, dtype=torch.bool)
        for chunk in entry.chunks:
            where = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
            what = f"{fqn!r}'s piece at {tuple(chunk.offsets)}"
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise CheckpointUnreadable(f"{what} has no storage")
            piece = _piece(files, info, what)
            if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != tuple(chunk.sizes):
                raise CheckpointUnreadable(f"{what} should be a tensor of {tuple(chunk.sizes)}")
            whole[where] = piece.to(whole.dtype)
            covered[where] = True
        if not bool(covered.all()):
            raise CheckpointUnreadable(f"{fqn!r}'s pieces leave {int((~covered).sum())} of its elements unsaved")
        values[fqn] = whole
    return values


def write_checkpoint(state: dict, path: str) -> dict[str, bytes]:
    """``state`` saved with ``dcp.save`` in this process (no process group: one piece per tensor) at
    ``path`` in its memory file system; the files, which are then removed from it."""
    from torch.distributed import checkpoint as dcp

    clear_memory_files(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path)
    files = memory_files(path)
    clear_memory_files(path)
    return files


def _memory(path: str):
    import fsspec

    return fsspec.filesystem("memory"), "/" + path.split("://", 1)[-1].strip("/")


def clear_memory_files(path: str) -> None:
    """Remove ``path`` from this process's fsspec memory file system (a warm rank keeps it between runs)."""
    fs, root = _memory(path)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def memory_files(path: str) -> dict[str, bytes]:
    """The files under ``path`` of this process's fsspec memory file system, by name relative to it."""
    fs, root = _memory(path)
    return {name[len(root) + 1 :]: bytes(fs.cat_file(name)) for name in fs.find(root)}


def put_memory_files(path: str, files: dict[str, bytes]) -> None:
    """Write ``files`` (names relative to ``path``) under ``path`` in this process's fsspec memory file system."""
    fs, root = _memory(path)
    for name, data in files.items():
        fs.pipe_file(f"{root}/{name}", bytes(data))
