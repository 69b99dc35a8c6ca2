"""Drafters: every proposer of draft trees, registered by name (`build(name, target=target, **options)`, `names()`).
Each module registers itself on import with `@register("name")`; the invariant tests pick it up.
"""

import importlib
import pkgutil

from specdec.core.draft import Acceptance, Draft, Drafter, DraftRequest, Step
from specdec.drafters.registry import build, build_for_tests, names, register

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Acceptance", "Draft", "DraftRequest", "Drafter", "Step", "build", "build_for_tests", "names", "register"]
