"""The interactive strategy menu shown by the merge driver when no strategy is configured and stdin is a terminal.

Git runs the merge driver with the user's terminal on stdin and stderr (its stdout is not the terminal), so the
menu reads stdin and writes stderr.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from theta.merges import get

MANUAL = "manual"


@dataclass(frozen=True)
class Answer:
    strategy: str            # a strategy name, or MANUAL to leave the group in conflict
    for_all: bool            # apply to every remaining group it applies to


def ask(path: str, group: str, describe: str, choices: list[str], remaining: int,
        stdin: TextIO, out: TextIO) -> Answer:
    """Ask which strategy merges ``group``; ``remaining`` counts the conflicting groups after this one."""
    options = list(choices) + [MANUAL]
    out.write(f"\ntheta: {path}: group {group!r} ({describe}) changed on both sides.\n")
    for i, name in enumerate(options, 1):
        summary = ("stop here; resolve by hand (git theta merge-manual writes the three versions)"
                   if name == MANUAL else get(name).summary)
        out.write(f"  {i}) {name:<16} {summary}\n")
    while True:
        out.write(f"Strategy for {group!r} [1-{len(options)} or name]: ")
        out.flush()
        line = stdin.readline()
        if not line:
            # end of input: nothing chosen, the group stays in conflict
            out.write("\n")
            return Answer(MANUAL, True)
        reply = line.strip()
        chosen = None
        if reply.isdigit() and 1 <= int(reply) <= len(options):
            chosen = options[int(reply) - 1]
        elif reply in options:
            chosen = reply
        if chosen is None:
            out.write(f"  please answer a number from 1 to {len(options)} or a strategy name\n")
            continue
        if remaining == 0 or chosen == MANUAL:
            return Answer(chosen, chosen == MANUAL)
        out.write(f"Use {chosen!r} for all {remaining} remaining conflicting group(s) too? [y/N]: ")
        out.flush()
        return Answer(chosen, stdin.readline().strip().lower() in ("y", "yes"))
