"""Drafters: every proposer of draft trees, registered by name.

`specdec.drafters.build(name, target=target, **options)` builds one; `names()` lists them. Importing
this package imports every drafter module, so each registers itself; adding a drafter means adding
its module here and nothing else.
"""

from specdec.drafters.base import Acceptance, Draft, Drafter, DraftRequest, build, names, register

from specdec.drafters import basic, ngram, model  # noqa: E402,F401  (registration side effects)

__all__ = ["Acceptance", "Draft", "DraftRequest", "Drafter", "build", "names", "register"]
