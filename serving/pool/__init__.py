"""Adapter placement: which adapters are in the model, under which version, leased by whom.

It imports :mod:`adapters`, the engine's model lock and AMoLE types, and serving's bottom modules;
the composition layer above it (targets, the stack, adapter administration) uses these names.
"""

from serving.pool.pool import AdapterPool, Lease
from serving.pool.run import ClientFiles, RunInfo
from serving.pool.views import AdapterInfo

__all__ = ["AdapterInfo", "AdapterPool", "ClientFiles", "Lease", "RunInfo"]
