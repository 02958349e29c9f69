"""Byte-compile the ftcomm package before timing process starts.

Python compiles each module it imports and caches the result in ``__pycache__``; an
installed wheel ships compiled, and an editable install compiles on the first run. With
``PYTHONDONTWRITEBYTECODE`` set (as on some CI images) nothing is cached and every new
worker compiles the package again, about 0.1 s of its ``init()`` on a 2-core machine:
a cost a user's second run does not pay, and that the installed peers compared with do
not pay at all. The benchmarks that time a process's start call :func:`compile_package`
first; a set variable still lets cached bytecode be read.
"""

from __future__ import annotations

import compileall
import os

import ftcomm


def compile_package() -> bool:
    """Write ftcomm's bytecode cache where it is missing or stale; True when it is whole."""
    return compileall.compile_dir(os.path.dirname(ftcomm.__file__), quiet=1)
