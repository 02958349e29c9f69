"""Communicator backends: ``gloo`` (CPU, torch's ProcessGroupGloo) and ``nccl`` (CUDA, libnccl via ctypes).

A backend is a class with ``form(store, rank, size, view_id, abort, timeout)`` returning
a communicator whose collectives return :class:`~ftcomm.backends.base.Handle`.
"""

from __future__ import annotations

BACKENDS = ("gloo", "nccl")


def communicator_class(backend: str):
    """The communicator class of ``backend``; NcclUnavailable when NCCL cannot run here."""
    if backend == "gloo":
        from .gloo import GlooCommunicator
        return GlooCommunicator
    if backend == "nccl":
        import torch

        from ..errors import NcclUnavailable
        from .nccl import NcclCommunicator, load
        lib = load()
        if not torch.cuda.is_available():
            raise NcclUnavailable(f"backend='nccl' needs a CUDA device; torch {torch.__version__} sees none "
                                  f"(NCCL {'.'.join(map(str, lib.version))} found at {lib.path})")
        return NcclCommunicator
    raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
