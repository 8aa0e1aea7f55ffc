"""Benchmarks of fedmosaic: each module a script that prints its figures as JSON (``python -m bench.<x>.<name>``).

* :mod:`bench.serving`: the serving stack, engine, kernels and adapter pool;
* :mod:`bench.training`: training's rounds and steps, its stages and the methods' server-side costs.

What each measures, how to run it and the current figures: ``bench/README.md``; the measured rows over
time: ``bench/history.jsonl``. Nothing in the packages imports ``bench``.
"""
