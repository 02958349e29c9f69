"""Warm standby workers for ``ftcomm run --standby N``.

A standby is an interpreter started ahead of need: it imports torch and ftcomm, builds and
steps a tiny model once (the first optimizer imports ``torch._dynamo``, the first backward
starts autograd's machinery), then blocks on a pipe from the launcher. When a worker exits,
the launcher sends a standby the worker's environment and command line through that pipe;
the standby takes them on and runs the training script as ``python script.py`` would
(``__main__``, ``sys.argv``, ``sys.path[0]`` the script's directory), or the module as
``python -m module`` would. The script then calls ``ftcomm.init`` like any restarted worker
and receives the state from the group: what the standby saves is the interpreter's start.

Environment variables read while torch is imported (``OMP_NUM_THREADS``, ``MKL_*``, ...)
come from the launcher's environment, the same for every worker; per-worker variables
(``LOCAL_RANK``, ``FTCOMM_BIND``, ...) are read later, by the script and by ``ftcomm.init``.

A command can be run by a standby when it is a Python interpreter followed by an optional
``-u`` and then a script path or ``-m module`` (what ``ftcomm run train.py`` runs).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import json
import os
import pathlib
import re
import runpy
import sys
import types

FD_ENV = "FTCOMM_STANDBY_FD"
"""The environment variable that names a standby's two pipes, ``ORDERS,READY``: it reads its
worker's orders from the first and writes one byte to the second once it is prepared."""
IMPORTS_ENV = "FTCOMM_STANDBY_IMPORTS"
"""Comma-separated modules a standby imports beyond torch and ftcomm (``--standby-import``)."""
MAX_ORDER_BYTES = 16 << 20
PYTHON = re.compile(r"^python[\d.]*$")


def _after_interpreter(command: list[str]) -> list[str]:
    """What follows the interpreter and its ``-u`` options."""
    rest = command[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    return rest


def python_command(command: list[str]) -> str | None:
    """Why ``command`` cannot be run by a standby, or None when it can (a Python interpreter,
    an optional ``-u``, then a script or ``-m module``)."""
    if not command or not PYTHON.match(pathlib.Path(command[0]).name) and command[0] != sys.executable:
        return "its command is not a Python interpreter (python script.py ... or python -m module ...)"
    rest = _after_interpreter(command)
    if not rest:
        return "its command names no script"
    if rest[0] == "-m":
        return None if len(rest) > 1 and rest[1] and not rest[1].startswith("-") else "its -m names no module"
    if rest[0].startswith("-"):
        return (f"the interpreter option {rest[0]} cannot be applied to a running interpreter (only -u is "
                f"accepted; put options in PYTHON* environment variables)")
    return None


def standby_command(command: list[str]) -> list[str]:
    """The command that starts a standby for the workers' ``command``: its interpreter."""
    return [command[0], "-u", "-m", "ftcomm.ops.standby"]


def order(command: list[str], env: dict[str, str]) -> bytes:
    """What the launcher writes to a standby to make it the worker ``command`` with ``env``."""
    return json.dumps({"argv": _after_interpreter(command), "env": env, "cwd": os.getcwd()}).encode()


def preload(extra: list[str]) -> None:
    """Import and warm up what every training script needs first."""
    import importlib

    import torch
    import torch.distributed  # noqa: F401

    import ftcomm  # noqa: F401
    from ftcomm import group  # noqa: F401
    from ftcomm.backends import gloo  # noqa: F401

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo (about a second)
    model(torch.zeros(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    for name in extra:
        importlib.import_module(name)


def become(argv: list[str]) -> None:
    """Run ``argv`` (what follows the interpreter) in this interpreter, as ``python`` would."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in sys.argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif os.path.isfile(argv[0]):
        # As ``python script.py``: sys.argv[0] as given, __file__ absolute, the script's
        # directory first on sys.path, a fresh __main__ module (runpy.run_path would give
        # __file__ as given, relative, and sys.argv[0] the same).
        path = os.path.abspath(argv[0])
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")
        main = types.ModuleType("__main__")
        main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None, __spec__=None,
                             __loader__=importlib.machinery.SourceFileLoader("__main__", path))
        sys.modules["__main__"] = main
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(path)
        exec(code, main.__dict__)
    else:  # a directory or a zip file with a __main__.py
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    orders, ready = (int(fd) for fd in os.environ.pop(FD_ENV).split(","))
    extra = [m for m in os.environ.pop(IMPORTS_ENV, "").split(",") if m]
    preload(extra)
    try:
        os.write(ready, b"R")
    except OSError:  # the launcher is gone; its orders pipe says so next
        pass
    os.close(ready)
    with os.fdopen(orders, "rb") as pipe:
        data = pipe.read(MAX_ORDER_BYTES)  # until the launcher writes its order and closes
    if not data:
        return  # the launcher let this standby go (or is gone)
    message = json.loads(data)
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    become(message["argv"])


if __name__ == "__main__":
    main()
