"""Training state as plain data: a msgpack skeleton with tensors kept apart as raw bytes.

State crosses the network (reconcile) and the disk (checkpoints) in this form and in no
other: a *skeleton* of plain values (None, bools, numbers, strings, bytes, lists,
tuples and dicts keyed by plain scalars) in which every tensor is replaced by its index
in a separate list, plus each tensor's dtype and shape. Decoding never builds anything
but these types, so bytes from a peer or a file cannot run code (no pickle anywhere).

A state that holds anything else (a numpy scalar, a custom object) is refused with
:class:`~ftcomm.errors.StateError` naming where it sits, when it is registered and
whenever it is encoded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import torch

from ..errors import StateError

ALIGN = 64  # byte alignment of each tensor in a flat buffer (any dtype can view it)
MAX_SKELETON_BYTES = 64 << 20
MAX_TENSORS = 1 << 20
_TENSOR, _TUPLE = 1, 2  # msgpack extension type codes
MAX_DEPTH = 64
"""The deepest nesting of lists, tuples and dicts a state may have (a model's and an
optimizer's state dicts nest a few levels): decoding deeper data from a peer or a file
would exhaust the stack."""
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what msgpack can carry

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int8", "int16",
                 "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(t: torch.Tensor, where: str = "state") -> str:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise StateError(f"{where}: tensors of dtype {t.dtype} cannot be transferred or checkpointed")
    return name


def split(value: Any, where: str = "state") -> tuple[bytes, list[torch.Tensor]]:
    """Encode ``value`` as ``(skeleton, tensors)``; the tensors are detached, not copied.

    Raises StateError naming the path of the first value that is not plain data or a
    supported tensor.
    """
    tensors: list[torch.Tensor] = []

    def convert(item: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise StateError(f"{path}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, torch.Tensor):
            if type(item) not in (torch.Tensor, torch.nn.Parameter) or item.layout != torch.strided \
                    or item.is_quantized or item.device.type == "meta":
                raise StateError(f"{path}: a {type(item).__name__} with layout {item.layout} on {item.device} "
                                 f"is not a plain dense tensor")
            dtype_name(item, path)
            tensors.append(item.detach())
            return msgpack.ExtType(_TENSOR, (len(tensors) - 1).to_bytes(4, "little"))
        if item is None or type(item) in (bool, float, str, bytes):
            return item
        if type(item) is int:
            if not _INT_RANGE[0] <= item <= _INT_RANGE[1]:
                raise StateError(f"{path}: the integer {item} does not fit in 64 bits")
            return item
        if isinstance(item, Mapping):
            out = {}
            for key, sub in item.items():
                if not (key is None or type(key) in (bool, int, float, str)):
                    raise StateError(f"{path}: a dict key of type {type(key).__name__} ({key!r:.60}); "
                                     f"keys must be strings, numbers, bools or None")
                out[key] = convert(sub, f"{path}[{key!r}]", depth + 1)
            return out
        if type(item) is list:
            return [convert(sub, f"{path}[{i}]", depth + 1) for i, sub in enumerate(item)]
        if type(item) is tuple:
            items = [convert(sub, f"{path}[{i}]", depth + 1) for i, sub in enumerate(item)]
            return msgpack.ExtType(_TUPLE, _pack(items))
        raise StateError(f"{path}: a {type(item).__module__}.{type(item).__qualname__} is not a tensor or plain "
                         f"data (None, bool, int, float, str, bytes, list, tuple, dict); convert it (for example "
                         f"with int(), float() or .tolist()) or keep it out of the registered state")

    skeleton = _pack(convert(value, where))
    if len(skeleton) > MAX_SKELETON_BYTES:
        raise StateError(f"{where}: its non-tensor part takes {len(skeleton)} bytes (at most "
                         f"{MAX_SKELETON_BYTES}); keep large data in tensors")
    return skeleton, tensors


def join(skeleton: bytes, tensors: list[torch.Tensor]) -> Any:
    """The value :func:`split` encoded, with its tensor references resolved to ``tensors``.

    Raises StateError for anything malformed (the bytes may come from anywhere).
    """
    tuples = 0  # tuples being decoded, one inside the other (each is its own msgpack buffer)

    def hook(code: int, data: bytes) -> Any:
        nonlocal tuples
        if code == _TENSOR and len(data) == 4:
            index = int.from_bytes(data, "little")
            if index < len(tensors):
                return tensors[index]
            raise StateError(f"skeleton refers to tensor {index} of {len(tensors)}")
        if code == _TUPLE:
            if tuples >= MAX_DEPTH:
                raise StateError(f"skeleton nested more than {MAX_DEPTH} levels deep")
            tuples += 1
            try:
                items = _unpack(data, hook)
            finally:
                tuples -= 1
            if type(items) is list:
                return tuple(items)
        raise StateError(f"skeleton holds an unknown extension (type {code})")

    if len(skeleton) > MAX_SKELETON_BYTES:
        raise StateError("skeleton too large")
    value = _unpack(skeleton, hook)
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    """StateError when ``value`` nests lists, tuples and dicts more than MAX_DEPTH levels
    (checked without recursion: what walks it later recurses)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth > MAX_DEPTH:
                raise StateError(f"skeleton nested more than {MAX_DEPTH} levels deep")
            stack.extend((sub, depth + 1) for sub in (item.values() if isinstance(item, dict) else item))


def layout(tensors: list[torch.Tensor]) -> tuple[list[list], int]:
    """Each tensor's ``[offset, dtype, shape, nbytes]`` in a flat buffer, and the buffer's size."""
    entries, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append([offset, dtype_name(t), list(t.shape), nbytes])
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def check_layout(entries: Any, size: int) -> list[list]:
    """``entries`` (from a peer or a file) if each lies inside a buffer of ``size`` bytes and
    agrees with its dtype and shape; raise StateError otherwise."""
    if type(entries) is not list or len(entries) > MAX_TENSORS:
        raise StateError("tensor table is not a list of bounded length")
    for entry in entries:
        if type(entry) is not list or len(entry) != 4:
            raise StateError("tensor entry is not [offset, dtype, shape, nbytes]")
        offset, dtype, shape, nbytes = entry
        if type(dtype) is not str or dtype not in DTYPES or type(shape) is not list or len(shape) > 64 or \
                any(type(d) is not int or d < 0 for d in shape) or type(offset) is not int or \
                type(nbytes) is not int or offset < 0 or offset % ALIGN or offset + nbytes > size:
            raise StateError(f"tensor entry {entry!r:.120} is out of range")
        numel, extent = 1, 1  # extent: what torch computes strides from, even for an empty tensor
        for d in shape:
            numel, extent = numel * d, extent * max(d, 1)
        if extent >= 1 << 62:
            raise StateError(f"tensor entry {entry!r:.120}: shape {shape} is too large")
        if numel * DTYPES[dtype].itemsize != nbytes:
            raise StateError(f"tensor entry {entry!r:.120}: {nbytes} bytes for shape {shape} of {dtype}")
    return entries


def view(buffer: Any, offset: int, dtype: str, shape: list[int], nbytes: int) -> torch.Tensor:
    """The tensor stored at ``offset`` of a flat buffer (a uint8 tensor or a writable buffer), sharing its memory."""
    kind = DTYPES[dtype]
    if nbytes == 0:
        device = buffer.device if isinstance(buffer, torch.Tensor) else "cpu"
        return torch.empty(shape, dtype=kind, device=device)
    if isinstance(buffer, torch.Tensor):
        raw = buffer[offset:offset + nbytes]
    else:
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(kind).view(shape)


def signature(value: Any) -> list:
    """``[[path, dtype, shape], ...]`` of every tensor in ``value``: what must match between
    workers holding the same model."""
    out: list = []

    def walk(item: Any, path: str) -> None:
        if isinstance(item, torch.Tensor):
            out.append([path, str(item.dtype).removeprefix("torch."), list(item.shape)])
        elif isinstance(item, Mapping):
            for key, sub in item.items():
                walk(sub, f"{path}.{key}" if path else str(key))
        elif isinstance(item, (list, tuple)):
            for i, sub in enumerate(item):
                walk(sub, f"{path}[{i}]")

    walk(value, "")
    return out


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, strict_types=True)


def _unpack(data: bytes, hook: Any) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=hook, use_list=True,
                               max_str_len=len(data), max_bin_len=len(data), max_array_len=len(data),
                               max_map_len=len(data), max_ext_len=len(data))
    except StateError:
        raise
    except (Exception, RecursionError) as exc:  # msgpack raises several unrelated exception types
        raise StateError(f"malformed state encoding ({type(exc).__name__})") from None
