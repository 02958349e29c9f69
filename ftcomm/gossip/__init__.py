"""SWIM + Lifeguard gossip membership: who is alive, suspect, dead or left, and their metadata.

``protocol`` is the sans-I/O core; ``runtime`` drives it over UDP and TCP in a
background thread; ``sim`` drives many cores on a virtual clock.
"""

from .config import GossipConfig
from .faults import FaultFilter
from .protocol import MemberEvent, MemberInfo, Protocol
from .runtime import GossipEvent, GossipNode, Member, query_members

__all__ = [
    "FaultFilter", "GossipConfig", "GossipEvent", "GossipNode", "Member", "MemberEvent", "MemberInfo",
    "Protocol", "query_members",
]
