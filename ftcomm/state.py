"""The registered training state: what is digested, compared and copied between workers."""

from __future__ import annotations

import io
from typing import Any

import torch
import xxhash


class TrainingState:
    """Objects with ``state_dict``/``load_state_dict`` (model, optimizer, sampler, ...) and plain values.

    Plain values live in :attr:`values` (read and write them there); they are copied
    along with the objects when workers reconcile.
    """

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.values: dict[str, Any] = {}

    def register(self, **entries: Any) -> None:
        for name, entry in entries.items():
            if entry is None:
                continue
            if hasattr(entry, "state_dict") and hasattr(entry, "load_state_dict"):
                self.objects[name] = entry
            else:
                self.values[name] = entry

    @property
    def registered(self) -> bool:
        return bool(self.objects or self.values)

    def snapshot(self, step: int) -> dict[str, Any]:
        return {"step": step, "objects": {n: o.state_dict() for n, o in self.objects.items()},
                "values": dict(self.values)}

    def digest(self, step: int) -> int:
        """A 63-bit digest of the state and step, equal on workers holding equal state."""
        h = xxhash.xxh3_64()
        _feed(h, self.snapshot(step))
        return h.intdigest() >> 1

    def to_bytes(self, step: int) -> bytes:
        buffer = io.BytesIO()
        torch.save(self.snapshot(step), buffer)
        return buffer.getvalue()

    def load_bytes(self, data: bytes) -> int:
        """Load a state produced by :meth:`to_bytes`; returns its step."""
        snapshot = torch.load(io.BytesIO(data), weights_only=False)
        for name, obj in self.objects.items():
            obj.load_state_dict(snapshot["objects"][name])
        self.values.update(snapshot["values"])
        return int(snapshot["step"])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _feed(h: "xxhash.xxh3_64", value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(tensor_bytes(t))
    elif isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    else:
        h.update(repr(value).encode())
