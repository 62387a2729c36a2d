"""Griffe extension: the Sphinx roles of our docstrings as Markdown code.

The docstrings are read in editors and by ``help()`` as much as here, and name other objects the
Sphinx way (``:class:`~.database.Database```, ``:func:`sleep```). Markdown would print the role;
this keeps the name as code (the last part of it after ``~``, as Sphinx shows it).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):`(~?)\.?([^`]+)`")


def as_code(match: re.Match[str]) -> str:
    short, name = match.group(1), match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(as_code, obj.docstring.value)
