"""MkDocs hook: render the reST habits of our docstrings as Markdown in the API reference.

The code's docstrings use Sphinx roles (:func:`zipslice.load`) and ``::`` before literal blocks. mkdocstrings
renders docstrings with the page's Markdown, which would show the role names literally; this hook adds a
Markdown extension that turns a role into inline code and a trailing ``::`` into ``:`` (the indented block
after it is already a code block in Markdown).
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as etree

from markdown import Extension
from markdown.inlinepatterns import InlineProcessor
from markdown.preprocessors import Preprocessor

ROLE = r":(?:func|meth|class|mod|attr|data|exc|obj):`~?([^`]+)`"


class _Role(InlineProcessor):
    def handleMatch(self, m, data):  # noqa: N802 (Markdown's API)
        el = etree.Element("code")
        el.text = m.group(1)
        return el, m.start(0), m.end(0)


class _LiteralMarker(Preprocessor):
    def run(self, lines):
        out, fenced = [], False
        for line in lines:
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            elif not fenced and line.rstrip().endswith("::") and line.strip() != "::":
                line = line.rstrip()[:-1]
            out.append(line)
        return out


class ReSTRoles(Extension):
    def extendMarkdown(self, md):  # noqa: N802 (Markdown's API)
        md.inlinePatterns.register(_Role(ROLE, md), "rest_role", 200)  # before backticks (190)
        md.preprocessors.register(_LiteralMarker(md), "rest_literal", 5)


def on_config(config, **kwargs):
    config.markdown_extensions.append(ReSTRoles())
    return config
