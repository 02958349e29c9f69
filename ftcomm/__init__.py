"""ftcomm: coordinator-free fault-tolerant collectives for elastic data-parallel PyTorch training."""

__version__ = "0.1.0"
