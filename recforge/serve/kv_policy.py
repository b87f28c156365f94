"""Eviction order of the KV-cache pool's tiers: plain LRU, or segmented LRU (SLRU, in the style of 2Q).

Under ``slru`` each tier orders its users in two LRU segments, sized in pages::

    probation   users cached once (a new user, a user not seen since)       evicted first, LRU
    protected   users hit again (a lookup that reused their prefix, a       at most ``protected_share`` of the
                promotion from the host tier, a user on the ghost list)     tier's pages; past it, its least
                                                                            recently used go back to probation

so a burst of users seen once evicts other users seen once, not the users who keep coming back. A user
evicted from both tiers leaves its key on a bounded *ghost* list (``GhostList``); when it returns, its
new entry starts protected. Under ``lru`` there is one segment and no ghost list: the least recently
used user goes first, whatever its history.
"""

from __future__ import annotations

from collections import OrderedDict

POLICIES = ("lru", "slru")
GHOST_OVERHEAD = 160  # bytes of Python objects per remembered key (dict slot, str header), counted


class Segments:
    """Users of one tier in eviction order; see the module docstring.

    Args:
        protected_share: the protected segment's most pages, as a share of ``capacity`` (0: plain LRU).
        capacity: the tier's pages (may change: a host tier that grows as it fills).
    """

    def __init__(self, protected_share: float, capacity: int) -> None:
        self.share, self.capacity = protected_share, capacity
        self.probation: OrderedDict[str, int] = OrderedDict()  # user -> pages, least recently used first
        self.protected: OrderedDict[str, int] = OrderedDict()
        self.protected_pages = 0

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, user: str) -> bool:
        return user in self.probation or user in self.protected

    def is_protected(self, user: str) -> bool:
        return user in self.protected

    def add(self, user: str, pages: int, protected: bool = False) -> None:
        """``user`` (not yet held) as the most recently used of its segment."""
        if protected and self.share > 0:
            self.protected[user] = pages
            self.protected_pages += pages
            self._demote()
        else:
            self.probation[user] = pages

    def hit(self, user: str) -> None:
        """``user`` was used again: the most recently used of the protected segment (under LRU: of the tier)."""
        pages = self.remove(user)
        self.add(user, pages, protected=True)

    def touch(self, user: str) -> None:
        """``user`` was used (a write-back, not a reuse): most recently used within its own segment."""
        (self.protected if user in self.protected else self.probation).move_to_end(user)

    def remove(self, user: str) -> int:
        """Forget ``user``; its pages."""
        if user in self.protected:
            pages = self.protected.pop(user)
            self.protected_pages -= pages
            return pages
        return self.probation.pop(user)

    def victim(self) -> str:
        """The user to evict next: the least recently used on probation, else the least recently used protected."""
        return next(iter(self.probation or self.protected))

    def _demote(self) -> None:
        limit = self.share * self.capacity
        while self.protected_pages > limit and self.protected:
            user, pages = self.protected.popitem(last=False)
            self.protected_pages -= pages
            self.probation[user] = pages  # the most recently used on probation: it was protected until now


class GhostList:
    """Keys of recently evicted users, the oldest forgotten first past ``limit_bytes`` (each key costs its
    UTF-8 bytes plus ``GHOST_OVERHEAD``)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.keys: OrderedDict[str, int] = OrderedDict()  # user -> bytes, oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.keys)

    def remember(self, user: str) -> None:
        cost = len(user.encode()) + GHOST_OVERHEAD
        if cost > self.limit:
            return
        self.forget(user)
        self.keys[user] = cost
        self.bytes += cost
        while self.bytes > self.limit:
            self.forget_oldest()

    def take(self, user: str) -> bool:
        """Whether ``user`` was remembered (it returned); it is forgotten either way."""
        return self.forget(user)

    def forget(self, user: str) -> bool:
        cost = self.keys.pop(user, None)
        if cost is None:
            return False
        self.bytes -= cost
        return True

    def forget_oldest(self) -> None:
        _, cost = self.keys.popitem(last=False)
        self.bytes -= cost


__all__ = ["GHOST_OVERHEAD", "POLICIES", "GhostList", "Segments"]
