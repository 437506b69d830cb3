"""Codecs, one module per codec; importing this package registers every built-in codec.

Every module of the package is imported here, so a new codec is one new file (see
``docs/codecs.md``).
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
