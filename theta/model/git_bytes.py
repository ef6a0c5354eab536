"""Each group's fast hash, taken from the bytes git pipes to the clean filter as they arrive.

In a `git add`, git sends the whole work-tree file through the filter's pipe. The clean used to read that
file twice more: once to prove git's bytes were the file's (compared packet by packet) and once to hash
every group. Now the thread receiving git's packets hashes each group's byte range of git's own bytes
(xxh3-128, the fast hash an unchanged group is recognized by, :func:`theta.updates.fast_hash`), and:

- a group whose hash equals its previous version's is reused without being read from the file: git's bytes
  *are* the previous value, whatever the file holds now;
- a group the clean reads from the file (changed, or new) has the file's bytes hashed by the clean anyway;
  they must equal git's hash (:meth:`GroupHashes.check`), else the file changed while git read it;
- the bytes outside the groups (archive headers, the pickle) are still compared with the file.

So every byte the clean uses is proven to be git's, as before, and an unchanged group costs one read (git's)
instead of three. The clean thread publishes where the groups lie (:meth:`GroupHashes.expect`) as soon as
it has parsed the file; the receiving thread waits for that before it passes the first group's bytes.
"""
from __future__ import annotations

import threading

from theta.base.errors import FileChanged

LAYOUT_WAIT = 30.0  # seconds the receiving thread waits for the layout (then it compares every byte instead)


class GroupHashes:
    """The meeting point of the thread receiving git's bytes and the clean of the same file."""

    def __init__(self, name: str):
        self.name = name                                  # the file, for errors
        self._cond = threading.Condition()
        self._layout: list | None = None                  # [(start, end, key)] sorted, or [] (none)
        self._got: dict[str, str] = {}                    # key -> xxh3-128 of git's bytes of its range
        self._ended = False                               # no more hashes will come

    # -- the clean's side ----------------------------------------------------------------------------------
    def expect(self, ranges: list[tuple[int, int, str]]) -> set[str]:
        """Publish the byte ranges ``(start, end, key)`` of the groups to hash; returns the keys taken (ranges
        that overlap another are left out: those groups are read from the file as before). Only the first
        call counts (an empty layout if the receiving thread gave up waiting)."""
        ranges = sorted((s, e, k) for s, e, k in ranges if e > s)
        overlapping = set()
        for (s0, e0, k0), (s1, e1, k1) in zip(ranges, ranges[1:]):
            if s1 < e0:
                overlapping.update((k0, k1))
        taken = [r for r in ranges if r[2] not in overlapping]
        with self._cond:
            if self._layout is not None:
                return set()
            self._layout = taken
            self._cond.notify_all()
        return {k for _, _, k in taken}

    def no_layout(self) -> None:
        """Nothing will be hashed (the clean ended, or took a path that does not use git's hashes)."""
        with self._cond:
            if self._layout is None:
                self._layout = []
            self._cond.notify_all()

    def hash_of(self, key: str) -> str | None:
        """The fast hash of git's bytes of ``key`` (waits for them to arrive); None when they never will
        (the receiving ended early: the caller hashes the file itself)."""
        with self._cond:
            self._cond.wait_for(lambda: key in self._got or self._ended)
            return self._got.get(key)

    def check(self, key: str, file_hash: str) -> None:
        """Raise :class:`FileChanged` when git sent other bytes for ``key`` than the file's (``file_hash``)."""
        got = self.hash_of(key)
        if got is not None and got != file_hash:
            raise FileChanged(f"{self.name}: group {key!r} changed while git was reading the file; "
                              f"run the git command again")

    @property
    def decided(self) -> bool:
        """Whether the layout is known (published, or none will come)."""
        with self._cond:
            return self._layout is not None

    @property
    def hashed(self) -> int:
        """How many groups were hashed from git's bytes so far."""
        with self._cond:
            return len(self._got)

    # -- the receiving side ----------------------------------------------------------------------------------
    def layout(self, timeout: float = LAYOUT_WAIT) -> list[tuple[int, int, str]]:
        """The ranges to hash (waits for the clean to publish them; [] after ``timeout``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._layout is not None, timeout):
                self._layout = []
            return self._layout

    def put(self, key: str, digest: str) -> None:
        with self._cond:
            self._got[key] = digest
            self._cond.notify_all()

    def end(self) -> None:
        """No more hashes (git's bytes all arrived, or the receiving failed): wake every waiter."""
        with self._cond:
            self._ended = True
            if self._layout is None:
                self._layout = []
            self._cond.notify_all()
