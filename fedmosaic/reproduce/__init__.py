"""Paper 000 Table 1 reproduced: ``fedmosaic reproduce`` trains, evaluates and tabulates its cells.

A *cell* is one method x seed x weighting rule, trained with the in-process simulator, scored with
the batch evaluator (:mod:`fedmosaic.evaluation`) and kept as one JSON file, so a table is built over
several sessions and rebuilt from its committed cells (``bench/results/``) without training.

* :mod:`.table1`: the harness (train and score every missing cell, then tabulate);
* :mod:`.runs`: the trained runs behind the cells (reused, resumed, or derived from FedIT's rounds);
* :mod:`.cells`: the cell files (their names, settings and order);
* :mod:`.tables`: ``table1.md`` (mean ± std over seeds, per-task blocks, per-cell figures, losses);
* :mod:`.orderings`: paper 000's orderings tested example by example (paired bootstrap);
* :mod:`.results`: a results folder's generated ``README.md`` and ``table1.md`` (``--tables-only``);
* :mod:`.cli`: ``fedmosaic reproduce``.
"""
