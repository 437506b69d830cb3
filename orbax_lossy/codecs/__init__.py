"""Codecs: importing this package registers every built-in codec with the registry."""

from orbax_lossy.codecs import bitmask, cluster, exact, lc  # noqa: F401  (registration)
