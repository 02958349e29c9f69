"""Transmit-limited broadcast queue: the infection-style dissemination of membership news."""

from __future__ import annotations


class BroadcastQueue:
    """News about members, each sent a limited number of times, least-sent first.

    One entry per member: news about a member replaces older news about it (a newer
    incarnation or state supersedes what was queued). Entries are grouped by how often
    they were sent so that filling a packet takes the freshest news first without sorting.
    """

    def __init__(self) -> None:
        self._tiers: list[dict[str, bytes]] = [{}]  # tier t: entries sent t times
        self._tier_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._tier_of)

    def queue(self, member_id: str, encoded: bytes) -> None:
        old = self._tier_of.pop(member_id, None)
        if old is not None:
            del self._tiers[old][member_id]
        self._tiers[0][member_id] = encoded
        self._tier_of[member_id] = 0

    def take(self, budget: int, limit: int, first: bytes | None = None) -> list[bytes]:
        """Messages that fit in ``budget`` bytes, counting one transmission of each.

        ``first`` (if given) is placed first regardless of the queue (the buddy system
        puts a suspicion in front of the probe to the suspect). Entries sent ``limit``
        times are retired.
        """
        out: list[bytes] = []
        if first is not None:
            out.append(first)
            budget -= len(first) + 1
        if not self._tier_of:
            return out
        moved: list[tuple[str, bytes, int]] = []
        for tier, entries in enumerate(self._tiers):
            for member_id, encoded in entries.items():
                if len(encoded) + 1 > budget:
                    continue
                budget -= len(encoded) + 1
                out.append(encoded)
                moved.append((member_id, encoded, tier))
            if budget < 16:
                break
        for member_id, encoded, tier in moved:
            del self._tiers[tier][member_id]
            sent = tier + 1
            if sent >= limit:
                del self._tier_of[member_id]
                continue
            while len(self._tiers) <= sent:
                self._tiers.append({})
            self._tiers[sent][member_id] = encoded
            self._tier_of[member_id] = sent
        return out
