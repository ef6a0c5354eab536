"""`git theta log`: a checkpoint's history group by group, as a heat map (an HTML page, a PNG), one line per
commit, or JSON; the work is in :mod:`theta.commands.pictures`, imported when the command runs (it brings
numpy: `git theta -h` and the hooks stay light without it)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from zipslice.clistyle import JSON_OPTION, QUIET_OPTION, set_quiet


def log(args: Optional[List[str]] = typer.Argument(None, metavar="[REV-RANGE] [-- PATH...]",
                                                   help="Revisions as git log takes them (default HEAD), then "
                                                        "paths (after `--` if ambiguous)."),
        html: Optional[Path] = typer.Option(None, "--html", metavar="OUT",
                                            help="Write the heat map page (one self-contained HTML file; a "
                                                 "directory of them when several checkpoints changed)."),
        png_out: Optional[Path] = typer.Option(None, "--png", metavar="OUT",
                                               help="Write the heat map as a PNG image (needs matplotlib: "
                                                    "zipslice-theta[plot])."),
        exact: bool = typer.Option(False, "--exact",
                                   help="Read the groups whose norms the metadata does not record (older "
                                        "commits, values stored whole) instead of estimating them from LSH "
                                        "signatures."),
        max_count: Optional[int] = typer.Option(None, "--max-count", "-n", metavar="N", min=1,
                                                help="At most the N newest commits."),
        as_json: bool = JSON_OPTION, quiet: bool = QUIET_OPTION) -> None:
    """A checkpoint's history group by group: which layers changed, when, by how much, how each commit stored
    them. Reads metadata only (norms recorded at add time), unless --exact.

    Without --html/--png/--json: one line per commit. Colour on the page: ‖new − old‖ / ‖old‖ of each group
    against the commit before, log scale; click a layer to unfold its groups; hover a cell for its figures."""
    from theta.commands.pictures import log_command, split_revs_paths  # (numpy: `git theta -h` stays light)

    set_quiet(quiet)
    revs, paths = split_revs_paths(list(args or []))
    log_command(revs, paths, html, png_out, exact, max_count, as_json)
