"""Training benchmarks: a federated round against plain PEFT, a step's forward cost and FLOPs, the methods' stages.

:mod:`.plain_peft` and :mod:`.step_flops` are the helpers :mod:`.round` (and others) share; every other
module is a script (``python -m bench.training.<name> --help``). Decisions and the figures behind them:
``HISTORY.md`` here.
"""
