"""The registered training state: what is digested, compared and copied between workers."""

from __future__ import annotations

from typing import Any, Protocol

import msgpack
import torch
import xxhash

from ..core.engine import FINGERPRINT_MASK
from ..errors import StateError
from . import plain, sharded


class Participant(Protocol):
    """A registered object that follows the group's steps (:class:`ftcomm.ElasticSampler`,
    :class:`ftcomm.LinearLRScaling`). Every hook is optional: the group calls those an
    object defines, on the training thread, in this order of a step's life."""

    def bind_group(self, group: Any) -> None:
        """``register_state`` registered it with ``group`` (rank, world size and steps)."""

    def view_changed(self, rank: int, world: int, step: int) -> dict:
        """A view formed and the state is reconciled (identical everywhere, so every member
        decides alike); returns what it set, for the view change's ``policy``."""

    def check_step(self) -> None:
        """A gradient step begins; raise when the step cannot be valid (no batch drawn)."""

    def batch_valid(self) -> bool:
        """This member's batch is the one planned for the committed position and current
        world: a step that some member's invalid batch fed is not committed."""

    def step_ended(self, committed: bool) -> None:
        """The step was committed (its samples consumed) or discarded (to be redone)."""


class TrainingState:
    """Objects with ``state_dict``/``load_state_dict`` (model, optimizer, sampler, ...) and plain values.

    Plain values live in :attr:`values` (read and write them there); they are copied
    along with the objects when workers reconcile.
    """

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.values: dict[str, Any] = {}

    def register(self, **entries: Any) -> None:
        """Add entries; raise StateError naming any whose state is not tensors and plain data."""
        for name, entry in entries.items():
            if entry is None:
                continue
            stateful = hasattr(entry, "state_dict") and hasattr(entry, "load_state_dict")
            plain.split(sharded.to_local(entry.state_dict()) if stateful else entry, f"registered state {name!r}")
            if stateful:
                self.objects[name] = entry
            else:
                self.values[name] = entry

    @property
    def registered(self) -> bool:
        return bool(self.objects or self.values)

    def snapshot(self, step: int) -> dict[str, Any]:
        """The registered state; of a sharded model (FSDP2), this process's shards."""
        return {"step": step, "objects": {n: sharded.to_local(o.state_dict()) for n, o in self.objects.items()},
                "values": dict(self.values)}

    def digest(self, step: int) -> int:
        """A 63-bit digest of the state and step, equal on workers holding equal state."""
        h = xxhash.xxh3_64()
        _feed(h, self.snapshot(step))
        return h.intdigest() >> 1

    def fingerprint(self) -> int:
        """A 48-bit fingerprint of the registered modules' parameters and the optimizers'
        state (this process's shards of a sharded model), equal on workers holding
        bit-identical tensors: see :func:`tensor_sums` for what is left out (buffers, other
        objects, plain values: the reconcile's digest compares those)."""
        sums = tensor_sums(self.objects)
        return xxhash.xxh3_64_intdigest(b"".join(s.to_bytes(8, "little", signed=True) for s in sums.values())) \
            & FINGERPRINT_MASK

    def tensor_fingerprints(self) -> dict[str, int]:
        """Each tensor's sum (see :func:`tensor_sums`), by its path (``model.0.weight``,
        ``optimizer.state.3.exp_avg``): comparing two of these names the tensors that differ."""
        return tensor_sums(self.objects)

    def signature(self) -> int:
        """A 63-bit digest of the modules' parameter names, shapes and dtypes: equal on
        workers that train the same model (the optimizer's state may still differ)."""
        return xxhash.xxh3_64_intdigest(msgpack.packb(self.describe())) >> 1

    def describe(self) -> list:
        """What :meth:`signature` digests, to say how two workers' models differ."""
        return plain.signature(self._model_states())

    def transfer_limit(self) -> int:
        """The most tensor bytes a state sent by a peer may hold: generous (sixteen times this
        worker's modules, an optimizer's state included, and at least 1 GiB), yet a bound
        on what a peer can make this worker allocate."""
        modules = sum(t.numel() * t.element_size() for state in self._model_states().values()
                      for t in state.values() if isinstance(t, torch.Tensor))
        return max(1 << 30, 16 * modules)

    def _model_states(self) -> dict[str, dict]:
        """The tensors whose names, dtypes and shapes must match between workers: each
        registered module's state, and the model an object holds for the group (``model_state``:
        ftcomm.DiLoCo's global model)."""
        states = {n: sharded.to_local(m.state_dict()) for n, m in self._modules().items()}
        for name, obj in self.objects.items():
            if name not in states and hasattr(obj, "model_state"):
                states[name] = sharded.to_local(obj.model_state())
        return states

    def _modules(self) -> dict[str, torch.nn.Module]:
        """The registered objects that are modules: their shapes must match between workers."""
        return {n: o for n, o in self.objects.items() if isinstance(o, torch.nn.Module)}

    def pack(self, step: int, device: Any = "cpu") -> tuple[bytes, torch.Tensor]:
        """The state as a manifest (msgpack: step, plain skeleton, tensor table) and one flat
        uint8 tensor on ``device`` holding every tensor's bytes, 64-byte aligned."""
        skeleton, tensors = plain.split(self.snapshot(step))
        entries, size = plain.layout(tensors)
        data = torch.empty(size, dtype=torch.uint8, device=device)
        for t, entry in zip(tensors, entries):
            if entry[3]:
                plain.view(data, *entry).copy_(t)
        manifest = msgpack.packb({"step": step, "skeleton": skeleton, "tensors": entries, "size": size},
                                 use_bin_type=True)
        return manifest, data

    def unpack(self, manifest: bytes, data: torch.Tensor) -> int:
        """Load a state made by :meth:`pack` (from any peer: every field is checked and nothing
        but plain data is built); returns its step. Raises StateError when malformed."""
        try:
            record = msgpack.unpackb(manifest, raw=False, max_map_len=8, max_ext_len=0)
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise StateError(f"malformed state manifest ({type(exc).__name__})") from None
        if type(record) is not dict or type(record.get("step")) is not int or record["step"] < 0 or \
                type(record.get("skeleton")) is not bytes or record.get("size") != data.numel():
            raise StateError("malformed state manifest")
        entries = plain.check_layout(record.get("tensors"), data.numel())
        modules = self._modules()
        tensors = [plain.view(data, *entry) for entry in entries]
        snapshot = plain.join(record["skeleton"], tensors)
        if type(snapshot) is not dict or set(snapshot) != {"step", "objects", "values"} or \
                type(snapshot["objects"]) is not dict or type(snapshot["values"]) is not dict:
            raise StateError("the state received is not a snapshot of registered state")
        if set(snapshot["objects"]) != set(self.objects):
            raise StateError(f"the state received holds {sorted(snapshot['objects'], key=str)!r:.200} where this "
                             f"worker registered {sorted(self.objects)!r:.200}")
        for name in modules:  # checked before anything is loaded, so a mismatch leaves the state as it was
            _check_module_state(name, sharded.to_local(self.objects[name].state_dict()), snapshot["objects"][name])
        for name in sorted(self.objects, key=lambda n: n in modules):  # modules last: they cannot fail now
            state = snapshot["objects"][name]
            if name not in modules:  # kept by the object: its own memory, not a view of ``data``
                state = _detach_from(state, data)
            try:
                self.objects[name].load_state_dict(sharded.like(sharded.template(self.objects[name]), state))
            except Exception as exc:  # noqa: BLE001 - whatever the object's own check raises
                raise StateError(f"the state received for {name!r} does not load: {exc}"[:500]) from None
        self.values.update(_detach_from(snapshot["values"], data))
        return record["step"]


def _check_module_state(name: str, mine: Any, received: Any) -> None:
    """StateError unless ``received`` has exactly the keys, dtypes and shapes of the module state ``mine``."""
    if type(received) is not dict or set(received) != set(mine) or \
            sorted(plain.signature(received)) != sorted(plain.signature(dict(mine))):
        raise StateError(f"the state received for module {name!r} does not fit its parameters and buffers "
                         f"(other names, dtypes or shapes)")


def _detach_from(value: Any, data: torch.Tensor) -> Any:
    """``value`` with every tensor that views ``data`` replaced by a copy."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.numel() and value.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() \
            else value
    if isinstance(value, dict):
        return {k: _detach_from(v, data) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_detach_from(v, data) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def tensor_sums(objects: dict[str, Any]) -> dict[str, int]:
    """Each parameter of the registered modules and each tensor of the registered
    optimizers' state (this process's shard of a sharded one), as the wrap-around sum of its
    bytes read as 64-bit integers (32-, 16- or 8-bit words when its size is no multiple of
    8), by path (``model.0.weight``, ``optimizer.state.3.exp_avg``). Summed on the tensors'
    device, read back in one copy per device. Integer addition is exact and its order does
    not matter, so equal tensors give equal sums on any device; a changed word changes the
    sum (one flipped bit always does), but changes that cancel out (two words changed by
    opposite amounts, words swapped) do not.

    Only what replicas hold bit for bit: the modules' buffers (a batch norm's running
    statistics, computed from each replica's own batches) and other registered objects
    (a sampler, a scheduler, extras that may differ by rank) are left out; the reconcile's
    digest covers them when a view forms. Sparse tensors are left out too."""
    paths: list[str] = []
    sums: list[torch.Tensor] = []

    def walk(path: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                return
            flat = sharded.local(value).detach().resolve_conj().resolve_neg()
            if flat.is_quantized:
                flat = flat.int_repr()
            flat = flat.reshape(-1)
            if not flat.is_contiguous():
                flat = flat.contiguous()
            size, offset = flat.numel() * flat.element_size(), flat.storage_offset() * flat.element_size()
            # a word must fit the size and start where the tensor does in its storage
            word = next(d for n, d in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
                        if size % n == 0 and offset % n == 0)
            paths.append(path)
            sums.append(flat.view(word).sum(dtype=torch.int64) if flat.numel() else
                        torch.zeros((), dtype=torch.int64, device=flat.device))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{path}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{path}.{index}", item)

    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            for key, parameter in obj.named_parameters():
                walk(f"{name}.{key}", parameter)
        elif isinstance(obj, torch.optim.Optimizer):
            walk(f"{name}.state", obj.state_dict()["state"])
        elif hasattr(obj, "fingerprint_tensors"):  # (ftcomm.DiLoCo: its global model and outer state)
            walk(name, obj.fingerprint_tensors())
    if not sums:
        return {}
    by_device: dict[Any, list[int]] = {}
    for index, total in enumerate(sums):
        by_device.setdefault(total.device, []).append(index)
    values = [0] * len(sums)
    for indices in by_device.values():  # one copy to the host per device
        for index, value in zip(indices, torch.stack([sums[i] for i in indices]).cpu().tolist()):
            values[index] = value
    return dict(zip(paths, values))


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
