"""Batch offline evaluation of run directories (paper 000 section 5.1): the application layer's evaluator.

* :mod:`.evaluate`: the run evaluator (``evaluate_run``): every client's personalised model on every
  task's test set, then tables, plots and ``eval/results.json``; :mod:`.compare`: evaluated runs side
  by side (``--compare``);
* :mod:`.testsets`, :mod:`.inputs`: the test sets scored (the run's own, or any other with ``--test``,
  written to ``eval/test-sets/<name>/``) and the checks done before any model is loaded;
* :mod:`.backend`: what the evaluator asks of a generation backend (``EvalItem`` in, predictions out);
* :mod:`.stack_backend`: that backend over the serving stack (the same served targets as the HTTP API);
* :mod:`.metrics`, :mod:`.predictions`, :mod:`.tables`, :mod:`.plots`, :mod:`.weights`: scores, the
  resumable prediction cache, the Table-1 layout, the PNG plots and FedDPA's weight statistics;
* :mod:`.cli`: ``fedmosaic eval``.
"""
