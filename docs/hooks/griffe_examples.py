"""A griffe extension for the API reference: the source's docstrings head their doctests ``Example:``, which
Google-style parsing reads as an admonition of Markdown text (so ``[0.5, 0.5]`` in an output line would be taken
for a link); renamed ``Examples:``, they become an examples section, their ``>>>`` lines code."""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
