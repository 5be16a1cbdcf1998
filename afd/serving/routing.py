"""Which replica serves a request: the least loaded one, unless another holds the request's prompt
prefix in its KV cache and is not more than one batch busier.

The front end cannot see the replicas' caches; it keeps, per replica, the names of the full prompt
blocks it has sent there (the same chained names the block manager gives them), least recently used
first and no more than the replica's KV blocks. That mirror is an estimate: a replica may already
have evicted a block the mirror still lists, which costs a cache miss, never a wrong result.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from afd.kvcache.block_manager import prefix_names


class PrefixRouter:
    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, slack_tokens: int) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.slack = slack_tokens  # a replica may be this many outstanding tokens busier and still win by its prefix
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def _matched(self, replica: int, names: list[int]) -> int:
        seen, n = self._seen[replica], 0
        for name in names:
            if name not in seen:
                break
            n += 1
        return n

    def choose(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for a prompt, given each replica's outstanding tokens; remembers the choice."""
        least = min(range(len(loads)), key=lambda i: loads[i])
        names = prefix_names(prompt_ids, self.block_size)
        best, best_len = least, self._matched(least, names)
        for r in range(len(loads)):
            if loads[r] <= loads[least] + self.slack:
                n = self._matched(r, names)
                if n > best_len or (n == best_len and loads[r] < loads[best]):
                    best, best_len = r, n
        seen = self._seen[best]
        for name in names:
            seen[name] = None
            seen.move_to_end(name)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return best
