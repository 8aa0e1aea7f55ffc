"""Application benchmarks: what the ``fedmosaic`` command costs before it does any work (``--help``, ``--version``).

Every module is a script (``python -m bench.app.<name> --help``).
"""
