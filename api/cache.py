"""Last good answers of read endpoints, served (marked stale) while the database is unreachable."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class LastGood:
    """A bounded LRU map from request key to the last successful response body."""

    def __init__(self, max_entries: int = 50_000) -> None:
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_entries

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._max:
                self._data.popitem(last=False)

    def get(self, key: str) -> Any | None:
        with self._lock:
            return self._data.get(key)
