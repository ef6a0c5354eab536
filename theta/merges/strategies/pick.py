"""ours, theirs, ancestor: one side's value, whatever the dtype."""
from __future__ import annotations

from theta.merges.strategies.base import Strategy


class _Pick(Strategy):
    def compute(self, name, A, B, O, p):
        return {"ours": A, "theirs": B, "ancestor": O}[self.picks]


class Ours(_Pick):
    name, picks, summary = "ours", "ours", "keep our version of the group"


class Theirs(_Pick):
    name, picks, summary = "theirs", "theirs", "take their version of the group"


class Ancestor(_Pick):
    name, picks, needs_ancestor = "ancestor", "ancestor", True
    summary = "go back to the common ancestor's version"
