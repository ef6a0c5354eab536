#!/usr/bin/env python3
"""Write the command-line reference from the typer apps themselves, so it cannot drift from the code.

    python3 scripts/gen_cli_docs.py            # rewrite docs/reference/cli.md and docs/man/*.1
    python3 scripts/gen_cli_docs.py --check    # exit 1 (and say which) if a file is out of date

The man pages are installed with the package (share/man/man1, see pyproject.toml; `git theta install` writes
them there for an editable install: theta/commands/manpages.py): `git theta --help` is turned by git into
`man git-theta`, and `man zipslice` works too. Everything comes from
:func:`zipslice.clihelp.describe`, the same data `-h` prints.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zipslice import clihelp  # noqa: E402

REFERENCE = ROOT / "docs" / "reference" / "cli.md"
MAN_DIR = ROOT / "docs" / "man"


def apps():
    """(console script, program as typed, typer app, one-line description) of each command line."""
    import typer

    from theta.commands import cli as theta_cli
    from zipslice import cli as zipslice_cli

    return [
        ("zipslice", "zipslice", typer.main.get_command(zipslice_cli.app),
         "inspect, slice, compare and convert ML checkpoints without loading them whole"),
        ("git-theta", "git theta", typer.main.get_command(theta_cli._app()),
         "version ML checkpoints in git, parameter group by parameter group"),
    ]


def walk(command, prog: str):
    """(root doc, [(name, doc)] of visible subcommands, [(name, summary)] of hidden ones)."""
    root_ctx = command.make_context(prog, [], resilient_parsing=True)
    root = clihelp.describe(command, root_ctx)
    subs, hidden = [], []
    for name, sub in command.commands.items():
        if sub.hidden:
            hidden.append((name, clihelp.short_help(sub)))
            continue
        ctx = sub.make_context(name, [], parent=root_ctx, resilient_parsing=True)
        subs.append((name, clihelp.describe(sub, ctx)))
    return root, subs, hidden


# -- markdown ---------------------------------------------------------------------------------------

def _md_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _params(doc: clihelp.CommandDoc, root: bool) -> list[clihelp.ParamDoc]:
    """Arguments and options; -h/--help is listed once, for the program, not under every command."""
    return [*doc.arguments, *(p for p in doc.options if root or "--help" not in p.names)]


def _md_params(doc: clihelp.CommandDoc, root: bool = False) -> list[str]:
    out = []
    params = [(p.kind, p) for p in _params(doc, root)]
    if params:
        out += ["| | |", "|---|---|"]
        for _, p in params:
            extra = " (required)" if p.required and p.kind == "option" else ""
            if p.default is not None:
                extra += f" (default: `{p.default}`)"
            out.append(f"| `{p.names}` | {_md_cell(p.help)}{extra} |")
        out.append("")
    return out


def markdown() -> str:
    out = ["# Command-line reference", "",
           "Generated from the programs themselves by `python3 scripts/gen_cli_docs.py` (a test fails when this "
           "page is out of date). Both commands share one style: `-h`/`--help` on every command, `--version`, "
           "`-q`/`--quiet` (print nothing but the data asked for and errors), `--json` on every listing, names "
           "printed whole and last on their line, natural order (`layer.2` before `layer.10`) where sorted, errors "
           "as one line `PROG: error: MESSAGE` (usage errors add a hint to `-h`; exit status 2).", "",
           "Shell completion: `zipslice completion bash|zsh|fish` and `git theta completion bash|zsh|fish` print a "
           "script to source, e.g. `git theta completion bash >> ~/.bashrc` (the bash script also teaches git's "
           "own completion `git theta <TAB>`).", ""]
    for script, prog, command, about in apps():
        root, subs, hidden = walk(command, prog)
        out += [f"## `{prog}`", "", f"{root.summary}", "", "```", root.usage, "```", ""]
        out += _md_params(root, root=True)
        out += ["| command | what it does |", "|---|---|"]
        out += [f"| [`{name}`](#{(prog + ' ' + name).replace(' ', '-')}) | {_md_cell(s)} |" for name, s in root.commands]
        out.append("")
        for name, doc in subs:
            out += [f"### `{prog} {name}`", "", "```", doc.usage, "```", "", doc.summary, ""]
            for para in doc.body:
                out += [para, ""]
            out += _md_params(doc)
        if hidden:
            out += [f"### Commands git runs (hidden from `{prog} -h`)", "",
                    "| command | what it does |", "|---|---|"]
            out += [f"| `{prog} {name}` | {_md_cell(s)} |" for name, s in hidden]
            out.append("")
    from theta.commands.entry import FILTER_HELP  # git's filter program: no typer app, its help is the reference

    out += ["## `git-theta-filter`", "", "```", FILTER_HELP.rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


# -- man pages --------------------------------------------------------------------------------------

def _roff(text: str) -> str:
    text = text.replace("\\", "\\e").replace("-", "\\-")
    lines = []
    for line in text.splitlines():
        lines.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(lines)


def _roff_params(doc: clihelp.CommandDoc, root: bool = False) -> list[str]:
    out = []
    for p in _params(doc, root):
        extra = " (required)" if p.required and p.kind == "option" else ""
        if p.default is not None:
            extra += f" (default: {p.default})"
        out += [".TP", f"\\fB{_roff(p.names)}\\fR", _roff(" ".join(p.help.split()) + extra)]
    return out


def man_page(script: str, prog: str, command, about: str) -> str:
    root, subs, hidden = walk(command, prog)
    out = [f'.TH {script.upper()} 1 "" "zipslice-theta" "User Commands"', ".SH NAME",
           f"{script} \\- {_roff(about)}", ".SH SYNOPSIS", f".B {prog}", "\\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIARGS\\fR]...",
           ".SH DESCRIPTION", _roff(root.summary)]
    for para in root.body:
        out += [".PP", _roff(para)]
    out += [".PP", _roff(f"Every command takes -h (or --help) and prints its own help; `{prog} help COMMAND` "
                         "does the same." if script == "git-theta" else
                         "Every command takes -h (or --help) and prints its own help.")]
    out += [".SH OPTIONS", *_roff_params(root, root=True), ".SH COMMANDS"]
    for name, doc in subs:
        out += [f'.SS "{_roff(doc.usage)}"', _roff(doc.summary)]
        for para in doc.body:
            out += [".PP", _roff(" ".join(para.split()))]
        out += _roff_params(doc)
    if hidden:
        out += [".SH COMMANDS GIT RUNS", _roff("Configured by `git theta install`; not meant to be typed:")]
        for name, s in hidden:
            out += [".TP", f"\\fB{_roff(prog + ' ' + name)}\\fR", _roff(s)]
    out += [".SH EXIT STATUS", _roff("0 on success; 1 when a command fails (for `zipslice diff`: the checkpoints "
                                     "differ); 2 for a usage error" + (" or a failure of zipslice" if script == "zipslice"
                                                                        else "") + "; 130 when interrupted."),
            ".SH SEE ALSO",
            "\\fBgit\\fR(1), \\fBgit-lfs\\fR(1), \\fBzipslice\\fR(1)" if script == "git-theta"
            else "\\fBgit-theta\\fR(1)",
            ".PP", _roff("The full documentation: docs/ in the source distribution (reference/cli.md for every "
                         "option).")]
    return "\n".join(out) + "\n"


def outputs() -> dict[Path, str]:
    files = {REFERENCE: markdown()}
    for script, prog, command, about in apps():
        files[MAN_DIR / f"{script}.1"] = man_page(script, prog, command, about)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = ap.parse_args()
    stale = []
    for path, text in outputs().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if args.check and stale:
        print("out of date (run python3 scripts/gen_cli_docs.py): "
              + ", ".join(str(p.relative_to(ROOT)) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
