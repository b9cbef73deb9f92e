"""The optional packages the Trainer / TRL integration needs, refused in one line when missing."""
from __future__ import annotations

import importlib
from types import ModuleType

from memorize_core import fail

EXTRAS = {"trl": "trl", "peft": "trl", "datasets": "trl"}  # package -> the extra that installs it


def require(package: str) -> ModuleType:
    """Import `package`, or raise one ConfigError naming it and the install command."""
    try:
        return importlib.import_module(package)
    except ImportError:
        extra = EXTRAS.get(package, package)
        raise fail(package, "not installed", f"install the optional extra: pip install -c constraints.txt "
                   f"-e '.[{extra}]'") from None
