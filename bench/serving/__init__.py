"""Serving benchmarks: throughput, load, scale, hot-loading, routing, the engine's steps and kernels.

:mod:`.common` and :mod:`.load_probe` are the helpers the others share; every other module is a script
(``python -m bench.serving.<name> --help``). Decisions and the figures behind them: ``HISTORY.md`` here.
"""
