"""Paper 000 Table 1 layout when a test set lacks some or all of the clients' own tasks (issue 20).

Before, the Personalization block looked each client's own task up among the scored tasks and raised
``KeyError`` after every generation had run.
"""

from __future__ import annotations

from fedmosaic.evaluation import tables
from training.scoring import Scores


def grid(values: dict[str, dict[str, float]]) -> dict[str, dict[str, Scores]]:
    return {k: {t: Scores(v, v, v, 1) for t, v in per.items()} for k, per in values.items()}


def test_tables_without_some_or_all_own_tasks() -> None:
    client_tasks = {"c1": "sorting", "c2": "capitals"}
    mixed = grid({"c1": {"capitals": 10.0, "units": 30.0}, "c2": {"capitals": 50.0, "units": 70.0},
                  "base": {"capitals": 1.0, "units": 3.0}})
    blocks = tables.block_rows("M", mixed, ["c1", "c2"], client_tasks, "rouge1", extra=("global", "base"))
    pers, ttp = blocks["personalization"], blocks["ttp"]
    assert pers[0].values == (None, 50.0) and pers[0].avg == 50.0  # c1's own task is absent
    assert pers[1].label == "M [base]" and pers[1].values == (None, 1.0)
    assert ttp[0].values == (20.0, 60.0) and ttp[0].avg == 40.0
    notes = tables.coverage_notes(["c1", "c2"], client_tasks, ["capitals", "units"])
    md = tables.markdown(blocks, ["sorting", "capitals"], "rouge1", title="M on test set T", notes=notes)
    assert md.startswith("M on test set T\n") and "| M | n/a | 50.00 | 50.00 |" in md
    assert "Personalization n/a: the own task of c1 (sorting)" in md
    assert tables.blocks_json(blocks, ["sorting", "capitals"])["personalization"][0]["values"] == {
        "sorting": None, "capitals": 50.0}

    unseen = grid({"c1": {"units": 30.0}, "c2": {"units": 70.0}})
    blocks = tables.block_rows("M", unseen, ["c1", "c2"], client_tasks, "rouge1")
    assert list(blocks) == ["ttp"] and blocks["ttp"][0].values == (30.0, 70.0)
    notes = tables.coverage_notes(["c1", "c2"], client_tasks, ["units"])
    assert notes == ["Personalization omitted: no client's own task is in the test set. Test-Time "
                     "Personalization is each model's mean over the test set's 1 tasks."]
    md = tables.markdown(blocks, ["sorting", "capitals"], "rouge1", notes=notes)
    assert "**Personalization**" not in md and "| M | 30.00 | 70.00 | 50.00 |" in md
    assert tables.coverage_notes(["c1"], client_tasks, ["sorting"]) == []  # the usual protocol: no note
