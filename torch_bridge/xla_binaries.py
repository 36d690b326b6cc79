"""The GPU binaries XLA compiles for a lowered JAX function's kernels: the very code JAX runs.

XLA's GPU compiler can write every kernel it builds to a *kernel cache file* (the debug option
``xla_gpu_kernel_cache_file``; XLA's ``CompilationCacheProto``): per kernel name, its launch dimensions, its dynamic
shared memory and its binary (a cubin). :func:`compiled_kernels` compiles a ``jax.stages.Lowered`` with that option
pointed at a fresh temporary file and reads it back. Each Pallas ``pallas_call`` appears under its ``name=``.

The file is a protocol buffer; the few fields read here are decoded by :func:`_fields` (the wire format: varints
and length-delimited fields) rather than by XLA's generated classes, which jaxlib does not ship. Anything
unexpected raises :class:`CacheFormatError`, and callers fall back to a route that does not need the binaries.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

KERNEL_CACHE_OPTION = "xla_gpu_kernel_cache_file"
ELF_MAGIC = b"\x7fELF"


class CacheFormatError(RuntimeError):
    """XLA wrote no kernel cache, or one this reader does not understand (a JAX/XLA release changed it)."""


@dataclasses.dataclass(frozen=True)
class KernelBinary:
    """One compiled kernel: launched on ``blocks`` blocks of ``threads`` threads with ``shared_bytes`` of dynamic
    shared memory (``cluster``: thread-block cluster shape, None for none)."""

    name: str
    cubin: bytes
    blocks: int
    threads: int
    shared_bytes: int
    cluster: tuple[int, int, int] | None


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise CacheFormatError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes) -> dict[int, list]:
    """A protocol-buffer message's fields: number -> values in order (ints for varints, bytes for the rest)."""
    out: dict[int, list] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = data[i:i + size], i + size
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i:i + size], i + size
        else:
            raise CacheFormatError(f"unsupported wire type {wire} in field {number}")
        if number == 0 or i > len(data):
            raise CacheFormatError("malformed message")
        out.setdefault(number, []).append(value)
    return out


def _one(fields: dict[int, list], number: int, default=None):
    values = fields.get(number)
    return default if not values else values[-1]


def _dims(data: bytes | int | None) -> tuple[int, int, int]:
    """A dimension field: an integer (XLA's 1-D form) or a message with x, y, z."""
    if data is None:
        return 1, 1, 1
    if isinstance(data, int):
        return data, 1, 1
    f = _fields(data)
    return tuple(int(_one(f, k, 1)) for k in (1, 2, 3))  # type: ignore[return-value]


def parse_kernel_cache(data: bytes) -> dict[str, KernelBinary]:
    """Read a ``CompilationCacheProto``: ``entries`` (field 1, a map name -> entry); each entry holds launch
    dimensions (2: blocks, threads per block), an optional cluster shape (3), dynamic shared memory (4) and the
    binary (5)."""
    kernels = {}
    for entry in _fields(data).get(1, []):
        pair = _fields(entry)
        name, value = _one(pair, 1), _one(pair, 2)
        if not isinstance(name, bytes) or not isinstance(value, bytes):
            raise CacheFormatError("kernel cache entry without a name or a value")
        f = _fields(value)
        launch, binary = _fields(_one(f, 2, b"")), _one(f, 5)
        if not isinstance(binary, bytes) or not binary.startswith(ELF_MAGIC):
            raise CacheFormatError(f"kernel {name.decode()!r}: its binary is not an ELF cubin")
        blocks, threads = _dims(_one(launch, 1)), _dims(_one(launch, 2))
        cluster = _dims(_one(f, 3)) if 3 in f else None
        kernels[name.decode()] = KernelBinary(
            name=name.decode(), cubin=binary, blocks=blocks[0] * blocks[1] * blocks[2],
            threads=threads[0] * threads[1] * threads[2], shared_bytes=int(_one(f, 4, 0)),
            cluster=None if cluster in (None, (1, 1, 1)) else cluster)
    return kernels


def compiled_kernels(lowered) -> dict[str, KernelBinary]:
    """Compile ``lowered`` (``jax.jit(f).trace(...).lower()``) for the GPU and return its kernels by name."""
    with tempfile.TemporaryDirectory(prefix="pallas_norm_kernels_") as tmp:
        path = os.path.join(tmp, "kernels.pb")
        lowered.compile(compiler_options={KERNEL_CACHE_OPTION: path})
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError as err:
            raise CacheFormatError(f"XLA wrote no kernel cache file ({KERNEL_CACHE_OPTION})") from err
    return parse_kernel_cache(data)
