"""A sum across the group in 8-bit integers, the same on every member.

An all-reduce cannot add 8-bit integers (the sum of two overflows), so the sum runs in
two exchanges of one byte per element, as a reduce-scatter and an all-gather would:

1. each member cuts its float32 tensor into one chunk per rank, quantizes each block of
   ``BLOCK`` elements to int8 with a float32 scale of its own (the block's largest
   magnitude / 127, rounded to nearest), and sends chunk ``j`` to rank ``j`` (alltoall);
2. rank ``j`` dequantizes the chunks it received, adds them in float32, quantizes that
   sum the same way, and every rank gathers every rank's summed chunk
   (allgather) and dequantizes it.

Each chunk's sum is computed by one rank and every member dequantizes the same bytes,
so the result is bit-equal on every member. Each member sends and receives
2 (W - 1) / W bytes per element (plus 4 bytes of scale per ``BLOCK``), a quarter of a
float32 ring all-reduce's. The error of one element is at most half a quantization step
of its block on the way out plus half a step of the summed block on the way back. A
block holding a NaN or an infinity comes back as NaNs; finite values and sums beyond
float32's range saturate at its largest value (as they would not in a float32 sum,
which overflows to an infinity).
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends.base import Handle, then

BLOCK = 256  # elements per scale: 1.6 % more bytes, and an outlier spoils 255 neighbours at most
_MAX = torch.finfo(torch.float32).max


def chunk_size(numel: int, world: int) -> int:
    """Elements of each rank's chunk: the tensor padded to ``world`` chunks of whole blocks."""
    blocks = -(-numel // (world * BLOCK))
    return max(1, blocks) * BLOCK


def pack(values: torch.Tensor) -> torch.Tensor:
    """Rows of float32 (a multiple of ``BLOCK`` each) as int8 rows: the quantized values,
    then each block's scale as four bytes."""
    rows, size = values.shape
    blocks = values.reshape(rows, size // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127.0  # NaN when a block holds one
    finite = torch.isfinite(scale)
    divisor = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    q = torch.nan_to_num(torch.round(blocks / divisor.unsqueeze(-1)), 0.0, 0.0, 0.0).clamp_(-127, 127)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    out = torch.empty(rows, size + 4 * (size // BLOCK), dtype=torch.int8, device=values.device)
    out[:, :size] = q.reshape(rows, size).to(torch.int8)
    out[:, size:] = scale.contiguous().view(torch.int8)
    return out


def unpack(packed: torch.Tensor, size: int) -> torch.Tensor:
    """The float32 rows that :func:`pack` made ``packed`` from, as quantized."""
    rows = packed.shape[0]
    scale = packed[:, size:].contiguous().view(torch.float32)
    q = packed[:, :size].to(torch.float32).reshape(rows, size // BLOCK, BLOCK)
    # (127 x a scale rounded up may pass float32's largest value: saturate, NaN stays NaN)
    return (q * scale.unsqueeze(-1)).clamp_(-_MAX, _MAX).reshape(rows, size)


def reduce_chunks(received: torch.Tensor, size: int) -> torch.Tensor:
    """Step 2 at one rank: the chunks every rank sent it (row ``i`` from rank ``i``), summed
    in float32 and packed again (one row)."""
    return pack(unpack(received, size).sum(dim=0, keepdim=True).clamp_(-_MAX, _MAX))[0]


def quantized_sum(comm: Any, flat: torch.Tensor) -> Handle:
    """Start summing the 1-D float32 ``flat`` across ``comm``'s view in int8 (see the
    module); once the handle's ``wait`` returns, ``flat`` holds the sum, bit-equal on
    every member. Failures as the communicator's collectives."""
    numel, world = flat.numel(), comm.size
    size = chunk_size(numel, world)
    padded = torch.zeros(world * size, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat

    def finish(gathered: list[torch.Tensor]) -> list[torch.Tensor]:
        flat.copy_(unpack(torch.stack(list(gathered)), size).reshape(-1)[:numel])
        return [flat]
    return then(comm.alltoall(pack(padded.view(world, size))),
                lambda received: comm.allgather(reduce_chunks(received, size)), f"int8 sum in view {comm.view_id}",
                finish)


def reference_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """What :func:`quantized_sum` gives over members holding ``tensors`` (in rank order),
    computed in one process: for tests and for judging the error."""
    world, numel = len(tensors), tensors[0].numel()
    size = chunk_size(numel, world)
    sent = []
    for t in tensors:
        padded = torch.zeros(world * size, dtype=torch.float32)
        padded[:numel] = t.reshape(-1).float()
        sent.append(pack(padded.view(world, size)))
    summed = [reduce_chunks(torch.stack([sent[i][j] for i in range(world)]), size) for j in range(world)]
    return unpack(torch.stack(summed), size).reshape(-1)[:numel].view_as(tensors[0])
