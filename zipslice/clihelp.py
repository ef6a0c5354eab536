"""How the project's command lines explain themselves: help text, the reference docs, shell completion.

:func:`describe` turns a typer-made click command into data (:class:`CommandDoc`); :func:`render_help` prints
it for ``-h`` (no boxes, no type tags, flags and names never cut, wrapped at the terminal width);
``scripts/gen_cli_docs.py`` renders the same data as the markdown reference and the man pages.
:class:`StyledCommand` / :class:`StyledGroup` make typer use this help (``zipslice.clistyle.make_app`` does
it for every command). :func:`completion_script` prints the scripts behind ``completion SHELL``.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass, field

from typer.core import TyperCommand, TyperGroup

@dataclass
class ParamDoc:
    """One argument or option as help, man page and reference page show it."""

    names: str            # "-q, --quiet", "--to FORMAT", "PATH"
    help: str
    kind: str             # "argument" | "option"
    required: bool = False
    default: str | None = None


@dataclass
class CommandDoc:
    """A command (or the app itself) as help, man page and reference page show it."""

    path: str                                   # "zipslice convert"
    usage: str                                  # "zipslice convert [OPTIONS] SRC DST"
    summary: str                                # first paragraph of the docstring
    body: list[str]                             # further paragraphs
    arguments: list[ParamDoc] = field(default_factory=list)
    options: list[ParamDoc] = field(default_factory=list)
    commands: list[tuple[str, str]] = field(default_factory=list)   # visible subcommands: (name, summary)


def _metavar(param) -> str:
    if param.metavar:
        return param.metavar
    return (param.name or "VALUE").upper().replace("_", "-")


def _paragraphs(text: str | None) -> list[str]:
    text = textwrap.dedent(text or "").strip("\n")
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


def _param_doc(param) -> ParamDoc | None:
    if getattr(param, "hidden", False):
        return None
    if param.param_type_name == "argument":
        name = _metavar(param)
        if param.nargs != 1:
            name += "..."
        return ParamDoc(name, param.help or "", "argument", required=param.required)
    opts = sorted(param.opts, key=lambda o: (o.startswith("--"), o))
    names = ", ".join(opts)
    if param.secondary_opts:
        names += " / " + ", ".join(param.secondary_opts)
    if not param.is_flag:
        names += f" {_metavar(param)}"
        if param.multiple:
            names += " (repeatable)"
    default = None
    if not param.is_flag and param.default not in (None, (), [], "") and not callable(param.default):
        default = str(getattr(param.default, "value", param.default))
    return ParamDoc(names, param.help or "", "option", required=param.required, default=default)


def _usage(ctx, command) -> str:
    pieces = [ctx.command_path]
    if any(p.param_type_name == "option" and not getattr(p, "hidden", False) for p in command.params):
        pieces.append("[OPTIONS]")
    for p in command.params:
        if p.param_type_name != "argument":
            continue
        name = _metavar(p) + ("..." if p.nargs != 1 else "")
        pieces.append(name if p.required else f"[{name}]")
    if hasattr(command, "commands"):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def describe(command, ctx) -> CommandDoc:
    """The help of ``command`` (a click command made by typer) as data."""
    paras = _paragraphs(command.help)
    doc = CommandDoc(path=ctx.command_path, usage=_usage(ctx, command),
                     summary=paras[0] if paras else "", body=paras[1:])
    for p in command.get_params(ctx):
        d = _param_doc(p)
        if d is not None:
            (doc.arguments if d.kind == "argument" else doc.options).append(d)
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            doc.commands.append((name, short_help(sub)))
    return doc


def short_help(command) -> str:
    """The first sentence of a command's help, for command lists."""
    paras = _paragraphs(command.help)
    first = " ".join(paras[0].split()) if paras else ""
    m = re.match(r"(.+?(?<!e\.g)(?<!i\.e)[.!?])(\s|$)", first)
    return (m.group(1) if m else first).rstrip(".")


def _wrap(text: str, width: int, indent: str) -> str:
    """Rewrap a paragraph; an indented paragraph (an example) keeps its lines."""
    lines = text.splitlines()
    if lines and all(line.startswith(" ") or not line.strip() for line in lines):
        return "\n".join(indent + line for line in lines)
    return textwrap.fill(" ".join(text.split()), width=max(width, 40), initial_indent=indent,
                         subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def render_help(doc: CommandDoc, width: int | None = None, color: bool = False) -> str:
    """Help text in the style of both commands: usage, description, arguments, options, commands.

    A name or flag is never broken: entries too long for their column get their description on the next line.
    """
    width = width or min(shutil.get_terminal_size().columns, 100)
    bold = (lambda s: f"\x1b[1m{s}\x1b[0m") if color else (lambda s: s)
    out = [f"{bold('Usage:')} {doc.usage}", ""]
    for para in [doc.summary, *doc.body]:
        if para:
            out.extend([_wrap(para, width - 2, "  "), ""])

    def section(title: str, entries: list[tuple[str, str]]) -> None:
        if not entries:
            return
        out.append(bold(title + ":"))
        col = min(max(len(n) for n, _ in entries) + 4, 30)
        for name, text in entries:
            head = "  " + bold(name)
            text = " ".join(text.split())
            if len(name) + 4 > col:  # the name keeps its line; the text goes below
                out.append(head)
                if text:
                    out.append(_wrap(text, width, " " * col))
                continue
            body = textwrap.fill(text, width=max(width - col, 20), break_long_words=False,
                                 break_on_hyphens=False).splitlines() or [""]
            out.append(head + " " * (col - len(name) - 2) + body[0])
            out.extend(" " * col + line for line in body[1:])
        out.append("")

    def param_text(p: ParamDoc) -> str:
        extra = " (required)" if p.required and p.kind == "option" else ""
        if p.default is not None:
            extra += f" (default: {p.default})"
        return p.help + extra

    section("Arguments", [(p.names, param_text(p)) for p in doc.arguments])
    section("Options", [(p.names, param_text(p)) for p in doc.options])
    section("Commands", doc.commands)
    return "\n".join(out).rstrip() + "\n"


def _format_help(self, ctx, formatter) -> None:
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    formatter.write(render_help(describe(self, ctx), color=color))


class StyledCommand(TyperCommand):
    """typer's command with this module's help."""

    format_help = _format_help


class StyledGroup(TyperGroup):
    """typer's group with this module's help; lists only visible commands."""

    format_help = _format_help



# -- shell completion ------------------------------------------------------------------------------

SHELLS = ("bash", "zsh", "fish")


def _complete_var(prog: str) -> str:
    return "_" + re.sub(r"\W", "_", prog).upper() + "_COMPLETE"


def completion_script(prog: str, shell: str) -> str:
    """The completion script of ``prog`` (a console script built on typer) for ``shell``.

    typer answers completion requests itself when ``_PROG_COMPLETE`` is set; the scripts only ask it.
    For ``git-theta`` the bash script also defines ``_git_theta``, which git's own bash completion calls
    for ``git theta <TAB>``.
    """
    var = _complete_var(prog)
    func = "_" + re.sub(r"\W", "_", prog) + "_completion"
    if shell == "bash":
        script = (f"{func}() {{\n"
                  f"    local IFS=$'\\n'\n"
                  f"    COMPREPLY=( $(env COMP_WORDS=\"${{COMP_WORDS[*]}}\" COMP_CWORD=$COMP_CWORD "
                  f"{var}=complete_bash {prog}) )\n"
                  f"}}\n"
                  f"complete -o default -F {func} {prog}\n")
        if prog.startswith("git-"):
            sub = prog[4:]
            script += (f"# git {sub} <TAB>: git's bash completion calls _git_{sub}\n"
                       f"_git_{sub}() {{\n"
                       f"    local IFS=$'\\n'\n"
                       f"    COMPREPLY=( $(env COMP_WORDS=\"{prog} ${{COMP_WORDS[*]:2}}\" "
                       f"COMP_CWORD=$((COMP_CWORD - 1)) {var}=complete_bash {prog}) )\n"
                       f"}}\n")
        return script
    if shell == "zsh":
        return (f"#compdef {prog}\n"
                f"{func}() {{\n"
                f"  eval $(env _TYPER_COMPLETE_ARGS=\"${{words[1,$CURRENT]}}\" {var}=complete_zsh {prog})\n"
                f"}}\n"
                f"compdef {func} {prog}\n")
    if shell == "fish":
        args = f"{var}=complete_fish _TYPER_COMPLETE_ARGS=(commandline -cp) {prog}"
        return (f"complete --command {prog} --no-files --arguments "
                f"\"(env _TYPER_COMPLETE_FISH_ACTION=get-args {args})\" "
                f"--condition \"env _TYPER_COMPLETE_FISH_ACTION=is-args {args}\"\n")
    raise ValueError(f"no completion script for {shell!r}; choose one of {', '.join(SHELLS)}")
