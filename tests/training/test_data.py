"""Data: loaders and their errors, prompts, masking, partition invariants, the generated suite."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from training.data import (
    IGNORE,
    DataError,
    PromptConfig,
    Record,
    collate,
    data_dir,
    dirichlet,
    format_prompt,
    generate_suite,
    hold_out,
    leave_out,
    load_dataset,
    load_folder,
    pool,
    read_records,
    sample_clients,
    split_tasks,
    tokenize_record,
    write_suite,
)
from training.data.families import CAPITALS


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def feddpa_fixture(root: Path) -> Path:
    (root / "8").mkdir(parents=True)
    for i, task in enumerate(["snli", "cola"]):
        rows = [{"instruction": f"{task} q{j}", "output": f"a{j}", "task": task, "category": "c"} for j in range(5)]
        (root / "8" / f"local_training_{i}.json").write_text(json.dumps(rows))
    tests = [{"instruction": f"{t} t{j}", "output": "x", "task": t, "category": "c"} for t in ("snli", "cola")
             for j in range(3)]
    tests.append({"instruction": "snli q1", "output": "a1", "task": "snli", "category": "c"})  # a duplicate
    write_jsonl(root / "flan_test_200.jsonl", tests)
    return root


def test_feddpa_format_fixture_and_duplicates(tmp_path: Path) -> None:
    root = feddpa_fixture(tmp_path / "ds")
    with pytest.warns(UserWarning, match="1 test examples also appear"):
        ds = load_dataset(str(root))
    assert ds.client_ids == ["0", "1"] and ds.task_of("1") == "cola"
    assert ds.duplicates == 1 and len(ds.tests["snli"]) == 4 and ds.tasks == ["snli", "cola"]


@pytest.mark.skipif(data_dir() is None, reason="benchmark data not present (FEDMOSAIC_DATA_DIR unset)")
def test_real_benchmarks() -> None:
    ds = load_dataset("feddpa1")
    assert [len(c.train) for c in ds.clients] == [300] * 8
    assert sorted(len(v) for v in ds.tests.values()) == [200] * 8
    assert ds.task_of("0") == "definite_pronoun_resolution" and ds.task_of("7") == "wic"
    assert load_dataset("feddpa2").task_of("7") == "word_segment"
    with pytest.warns(UserWarning):
        dolly = load_dataset("dolly")
    assert dolly.task_of("0") == "brainstorming" and dolly.duplicates > 0
    assert any(r.input for c in dolly.clients for r in c.train)


def test_errors_name_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataError, match="unknown data set 'nope'"):
        load_dataset("nope")
    with pytest.raises(DataError, match="train does not exist"):
        load_folder(tmp_path)
    write_jsonl(tmp_path / "a" / "train" / "c1.jsonl", [{"instruction": "x"}])
    with pytest.raises(DataError, match=r"c1.jsonl:1: missing field 'output'"):
        load_folder(tmp_path / "a")
    (tmp_path / "b" / "train").mkdir(parents=True)
    (tmp_path / "b" / "train" / "c1.jsonl").write_text('{"instruction": "x", "output": "y"}\n{broken\n')
    with pytest.raises(DataError, match=r"c1.jsonl:2 is not valid JSON"):
        load_folder(tmp_path / "b")
    (tmp_path / "c" / "train").mkdir(parents=True)
    (tmp_path / "c" / "train" / "empty.json").write_text("[]")
    with pytest.raises(DataError, match="client 'empty' has no training examples"):
        load_folder(tmp_path / "c")
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / "train" / "c.json").write_text('{"instruction": "x"}')
    with pytest.raises(DataError, match="must hold a JSON list"):
        load_folder(tmp_path / "d")
    monkeypatch.setenv("FEDMOSAIC_DATA_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # an empty data cache
    assert data_dir() == tmp_path / "nowhere"
    with pytest.raises(DataError, match=r"'feddpa1' is not in .*nowhere/feddpa/dataset1 nor .*cache/fedmosaic/data/"
                                        r"feddpa/dataset1: run `fedmosaic data fetch feddpa1`"):
        load_dataset("feddpa1")
    monkeypatch.delenv("FEDMOSAIC_DATA_DIR")  # only the data cache is looked in: the error says how to fill it
    assert data_dir() is None
    with pytest.raises(DataError, match=r"fedmosaic data fetch feddpa1.*or set FEDMOSAIC_DATA_DIR"):
        load_dataset("feddpa1")


def test_prompts_and_masking(tokenizer: object) -> None:
    rec = Record(instruction="Sort: b a", output="a b")
    assert format_prompt(rec) == "### Instruction:\nSort: b a\n\n### Response:\n"
    with_input = Record(instruction="Summarize.", input="Long text.", output="Short.")
    assert "### Input:\nLong text.\n\n### Response:\n" in format_prompt(with_input)
    assert format_prompt(rec, tokenizer, PromptConfig("chat")).startswith("<|im_start|>user\nSort: b a")
    ex = tokenize_record(rec, tokenizer, cutoff_len=512)
    n_prompt = len(tokenizer(format_prompt(rec), add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    assert ex.labels[:n_prompt] == (IGNORE,) * n_prompt
    assert ex.labels[n_prompt:] == ex.input_ids[n_prompt:]
    assert ex.input_ids[-1] == tokenizer.eos_token_id  # type: ignore[attr-defined]
    short = tokenize_record(rec, tokenizer, cutoff_len=n_prompt + 1)
    assert len(short.input_ids) == n_prompt + 1 and short.input_ids[-1] != tokenizer.eos_token_id  # type: ignore[attr-defined]
    batch = collate([ex, short], pad_id=tokenizer.pad_token_id)  # type: ignore[attr-defined]
    assert batch["input_ids"].shape == (2, len(ex.input_ids))
    assert batch["attention_mask"][1].sum() == len(short.input_ids)
    assert (batch["labels"][1][len(short.input_ids):] == IGNORE).all()
    left = collate([ex, short], pad_id=0, left=True)
    assert left["attention_mask"][1, 0] == 0 and left["attention_mask"][1, -1] == 1


def test_partitions_keep_every_example_once() -> None:
    ds = generate_suite(n_train=20, n_test=5, families=["sorting", "capitals", "arithmetic"])
    split = split_tasks(ds, k=3, seed=1)
    assert len(split.clients) == 9
    assert Counter(pool(split)) == Counter(pool(ds))
    picked = sample_clients(split, rate=0.4, round_idx=3, seed=0)
    assert len(picked) == 3 and len({split.task_of(c) for c in picked}) == 3  # one per task
    assert picked == sample_clients(split, rate=0.4, round_idx=3, seed=0)
    assert len(sample_clients(split, rate=1.0, round_idx=0)) == 9
    with pytest.raises(DataError, match="sample rate"):
        sample_clients(split, rate=0.0, round_idx=0)

    records = pool(ds)
    a = dirichlet(records, n_clients=4, alpha=0.5, seed=7, min_size=5, label="task")
    b = dirichlet(records, n_clients=4, alpha=0.5, seed=7, min_size=5, label="task")
    c = dirichlet(records, n_clients=4, alpha=0.5, seed=8, min_size=5, label="task")
    assert Counter(pool(a)) == Counter(records)
    assert [cl.train for cl in a.clients] == [cl.train for cl in b.clients]
    assert [cl.train for cl in a.clients] != [cl.train for cl in c.clients]
    assert min(len(cl.train) for cl in a.clients) >= 5
    with pytest.raises(DataError, match="cannot give"):
        dirichlet(records, n_clients=10, alpha=0.5, min_size=10)

    held = hold_out(ds, 0.25, seed=4)
    for before, after in zip(ds.clients, held.clients, strict=True):
        assert len(after.validation) == 5 and len(after.train) == 15  # round(0.25 * 20)
        assert Counter(after.train + after.validation) == Counter(before.train)  # every example once
        assert [r for r in before.train if r in after.train] == list(after.train)  # order kept
    assert [c.validation for c in hold_out(ds, 0.25, seed=4).clients] == [c.validation for c in held.clients]
    assert [c.validation for c in hold_out(ds, 0.25, seed=5).clients] != [c.validation for c in held.clients]
    both = split_tasks(held, k=2, seed=1)  # the task split divides the held-out examples too
    validation = [r for c in held.clients for r in c.validation]
    assert Counter(r for c in both.clients for r in c.validation) == Counter(validation)
    assert Counter(pool(both)) == Counter(pool(held))
    loaded = load_dataset("generated", n_train=20, n_test=5, families=["sorting", "capitals", "arithmetic"],
                          hold_out=0.25, hold_out_seed=4)
    assert [c.validation for c in loaded.clients] == [c.validation for c in held.clients]
    for bad in (0.0, 0.6, -1, True):
        with pytest.raises(DataError, match="hold_out"):
            hold_out(ds, bad)  # type: ignore[arg-type]

    loo = leave_out(ds, ["capitals"])
    assert loo.held_out == ("capitals",) and "capitals" in loo.tests
    assert all(c.task != "capitals" for c in loo.clients)
    with pytest.raises(DataError, match="unknown tasks"):
        leave_out(ds, ["nope"])


def test_generated_suite_is_deterministic_correct_and_round_trips(tmp_path: Path) -> None:
    a, b = generate_suite(seed=3, n_train=40, n_test=10), generate_suite(seed=3, n_train=40, n_test=10)
    assert a == b and a != generate_suite(seed=4, n_train=40, n_test=10)
    assert len(a.clients) >= 8
    prefixes = {c.client_id: c.train[0].instruction.split()[0] for c in a.clients}
    assert len({c.train[0].instruction[:12] for c in a.clients}) == len(a.clients), prefixes
    for c in a.clients:
        train_q = {r.instruction for r in c.train}
        assert not train_q & {r.instruction for r in a.tests[c.task]}
        for r in c.train + a.tests[c.task]:
            if c.task == "arithmetic":
                x, y = map(int, re.findall(r"\d+", r.instruction)[:2])
                assert int(r.output) in (x + y, x - y)
            elif c.task == "unit_conversion":
                v = int(re.findall(r"\d+", r.instruction)[0])
                assert int(r.output.split()[0]) in (v * 1000, v * 100, v * 60)
            elif c.task == "sorting":
                words = r.instruction.split(": ")[1].split(", ")
                assert r.output == ", ".join(sorted(words))
            elif c.task == "capitals":
                assert r.output in CAPITALS.values() or r.output in CAPITALS
    root = write_suite(tmp_path / "suite", seed=3, n_train=40, n_test=10)
    back = load_folder(root)
    assert {c.client_id: c.train for c in back.clients} == {c.client_id: c.train for c in a.clients}
    assert back.tests == a.tests
    via_spec = load_dataset("generated", n_train=5, n_test=1)
    assert via_spec.clients[0].train == generate_suite(n_train=5, n_test=1).clients[0].train


def test_read_records_without_outputs_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [{"instruction": "q", "task": "qa"}, {"instruction": "r", "output": "s"}])
    with pytest.raises(DataError, match=r"t.jsonl:1: missing field 'output'"):
        read_records(path)  # training data must have outputs
    records = read_records(path, default_task="t", require_output=False)  # evaluation names the metric instead
    assert [(r.output, r.task) for r in records] == [("", "qa"), ("s", "t")]
    write_jsonl(path, [{"instruction": "q", "output": 3}])
    with pytest.raises(DataError, match="field 'output' must be a string"):
        read_records(path, require_output=False)


@pytest.mark.slow
@pytest.mark.skipif(data_dir() is None, reason="FedDPA data sets not present (FEDMOSAIC_DATA_DIR unset)")
def test_every_presets_cutoff_keeps_every_training_example_of_both_feddpa_sets() -> None:
    # at 192 / 256 tokens (the former small / medium) hellaswag lost 201 / 58 of its 300 training examples
    from transformers import AutoTokenizer

    from models.prepare import prepare_smollm2
    from training.data import PromptConfig, tokenize_record
    from training.local.regime import BUDGETS

    tok = AutoTokenizer.from_pretrained(prepare_smollm2())  # prepared once per cache (about 20 s), then reused
    cutoff = min(b.cutoff_len for name, b in BUDGETS.items() if name != "tiny")  # tiny is the random tiny model's
    for spec in ("feddpa1", "feddpa2"):
        for c in load_dataset(spec).clients:
            longest = max(len(tokenize_record(r, tok, 100_000, PromptConfig("alpaca_short")).input_ids)
                          for r in c.train)
            assert longest <= cutoff, (spec, c.task, longest)
