from setuptools import find_packages, setup

setup(
    name="ftcomm",
    version="0.1.0",
    description="Coordinator-free fault-tolerant collectives for elastic data-parallel PyTorch training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ftcomm", "ftcomm.*"]),
    install_requires=[
        "torch>=2.4",
        "pyzmq>=25",
        "msgpack>=1.0",
        "numpy>=1.24",
        "uvloop>=0.17; sys_platform != 'win32'",
        "xxhash>=3.0",
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3", "hypothesis>=6", "nvidia-nccl-cu12>=2.18",
                 "kubernetes>=29", "pyyaml>=6", "prometheus-client>=0.17", "ray>=2.9"],
        "ray": ["ray>=2.9"],
        "bench": ["matplotlib>=3.5"],
        "metrics": ["prometheus-client>=0.17"],
        "kubernetes": ["kubernetes>=29", "pyyaml>=6"],
        "nccl": ["nvidia-nccl-cu12>=2.18"],
        "nccl-cu13": ["nvidia-nccl-cu13>=2.27"],
    },
    entry_points={"console_scripts": ["ftcomm=ftcomm.ops.cli:main"]},
)
