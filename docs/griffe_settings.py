"""A griffe extension for the API page: the config classes' docstrings and `TideRouterConfig`'s keywords as Python
builds them. Their `Args:` are made from the fields' help in `tide_hf.settings`, which static analysis cannot see."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe

BUILT = ("tide_hf.settings.CalibrationConfig", "tide_hf.settings.RouterFields", "tide_hf.config.TideRouterConfig")
KINDS = {inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
         inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
         inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword}


class BuiltDocstrings(griffe.Extension):
    """Replace the static docstring (and `__init__` parameters) of each class of `BUILT` with the imported one's."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if cls.path not in BUILT:
            return
        module, _, name = cls.path.rpartition(".")
        built = getattr(importlib.import_module(module), name)
        cls.docstring = griffe.Docstring(inspect.cleandoc(built.__doc__), parent=cls)
        init = cls.members.get("__init__")
        if isinstance(init, griffe.Function):  # TideRouterConfig's takes **kwargs; its signature names the fields
            init.parameters = griffe.Parameters(*(
                griffe.Parameter(p.name, kind=KINDS[p.kind], annotation=None if p.annotation is p.empty
                                 else str(p.annotation), default=None if p.default is p.empty else repr(p.default))
                for p in inspect.signature(built.__init__).parameters.values()))
