"""A bounded memo for results keyed partly by objects' ids (the estimate's and the search's caches
kept across layouts): each entry holds the objects whose ids its key names, so no id is reused
while its entry lives; when full it is emptied (the search's working set is far below the bound)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

SIZE = 65536


class IdMemo:
    def __init__(self, size: int = SIZE):
        self.entries: dict[tuple, tuple[Any, Any]] = {}
        self.size = size

    def get(self, key: tuple, keep: Any, make: Callable[[], Any]) -> Any:
        """The result for ``key``, made by ``make()`` the first time; ``keep``: the objects the key's ids name."""
        hit = self.entries.get(key)
        if hit is None:
            if len(self.entries) >= self.size:
                self.entries.clear()
            hit = self.entries[key] = (keep, make())
        return hit[1]

    def find(self, key: tuple) -> Any:
        """The result kept for ``key``, or None."""
        hit = self.entries.get(key)
        return None if hit is None else hit[1]
