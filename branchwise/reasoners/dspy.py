"""Deprecated import path: the DSPy plug-in lives in `branchwise.integrations.dspy`.

Why this module is still here: `from branchwise.reasoners.dspy import ...` was the documented path
before the plug-in moved beside the LangChain one. It keeps resolving every name, with a
`DeprecationWarning`, so existing programs get a release to change one import line; nothing in the
package imports it, and it is removed in the next minor release.
"""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from branchwise.integrations import dspy as moved

    value = getattr(moved, name)  # a name the plug-in never had raises AttributeError here
    warnings.warn(
        f"branchwise.reasoners.dspy is deprecated: import {name} from branchwise.integrations.dspy",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
