"""Every error ftcomm raises, each with a message that says what to do next."""

from __future__ import annotations


class FtcommError(Exception):
    """Base class of all ftcomm errors."""


class GossipError(FtcommError):
    """The membership layer could not do what was asked (bind, reach a member, authenticate)."""


class JoinError(GossipError):
    """No seed member answered within the join timeout."""
