"""The end-of-training check of a client's local adapter on its held-out examples (known answers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters.generation import GenerationConfig, generate
from adapters.rundir import RunDir
from fedmosaic.cli import main
from models import tiny_llama
from routing.calibration import CALIBRATION_FILE, Calibration
from training.data import PromptConfig, Record, generate_suite, prompt_texts
from training.federation.local_gate import GateResult, check_local, verdict
from training.local.runtime import Runtime, preset
from training.scoring import example_scores, score

TOKENS = 8


def perturbed(rt: Runtime, name: str, seed: int) -> None:
    """Give adapter ``name`` a random B, so that it changes what the tiny model says."""
    gen = torch.Generator().manual_seed(seed)
    rt.set(name, {k: torch.randn(v.shape, generator=gen) * 0.5 if k.endswith("lora_B") else v
                  for k, v in rt.get(name).items()})


@pytest.fixture(scope="module")
def rt() -> Runtime:
    runtime = Runtime(tiny_llama(), preset("tiny"))
    perturbed(runtime, "global", 1)
    perturbed(runtime, "local", 2)
    return runtime


def check(rt: Runtime, records: list[Record], lambda_: float, **kwargs: float) -> GateResult:
    return check_local(rt.loaded, rt.adapted, rt.train.prompt_style, records, lambda_, **kwargs)  # type: ignore[arg-type]


def answers(rt: Runtime, records: list[Record], a: float) -> list[str]:
    prompts = prompt_texts(records, rt.tokenizer, PromptConfig(rt.train.prompt_style))
    return generate(rt.adapted, rt.model, rt.tokenizer, prompts, ("global", "local"), [1.0 - a, a],
                    GenerationConfig(max_new_tokens=TOKENS))


def test_the_gate_keeps_lambda_only_when_the_mix_answers_better(rt: Runtime) -> None:
    asked = list(generate_suite(n_train=12, n_test=1, families=["sorting"]).clients[0].train)
    by_global, by_mix = answers(rt, asked, 0.0), answers(rt, asked, 0.5)
    assert by_global != by_mix and score(by_global, by_global).rouge1 > 0
    # the references are what the global adapter alone says: the mix can only lose
    said_by_global = [Record(r.instruction, out) for r, out in zip(asked, by_global, strict=True)]
    closed = check(rt, said_by_global, 0.5, max_new_tokens=TOKENS)
    assert closed.gain == 0.0 and closed.n == 12
    assert closed.global_score == pytest.approx(score(by_global, by_global).rouge1)
    assert closed.mixed_score == pytest.approx(score(by_mix, by_global).rouge1)
    assert closed.mixed_score < closed.global_score
    # the references are what the mix says: the local adapter helps
    said_by_mix = [Record(r.instruction, out) for r, out in zip(asked, by_mix, strict=True)]
    # the mix wins wherever the global's answer scores below 100 against it (a naive count)
    wins = sum(example_scores(g, m)["rouge1"] < example_scores(m, m)["rouge1"]
               for g, m in zip(by_global, by_mix, strict=True))
    kept = check(rt, said_by_mix, 0.5, max_new_tokens=TOKENS)
    assert (kept.wins, kept.losses) == (wins, 0) and kept.p_value == pytest.approx(0.5 ** wins)
    assert wins >= 5 and kept.gain == 1.0 and kept.mixed_score > kept.global_score  # 5 of 5: p = 1/32 < 0.05
    assert kept.asdict() == {"metric": "rouge1", "lambda": 0.5, "global": kept.global_score,
                             "mixed": kept.mixed_score, "n": len(asked), "wins": wins, "losses": 0,
                             "p_value": kept.p_value, "alpha": 0.05, "gain": 1.0}
    # the same evidence at a stricter level than it can reach keeps the global alone
    assert check(rt, said_by_mix, 0.5, max_new_tokens=TOKENS, alpha=0.5 ** (wins + 1)).gain == 0.0


def test_the_verdict_needs_a_higher_mean_and_a_significant_sign_test() -> None:
    # a few large wins, more small losses: the mean favours the mix, the examples do not (the fix_punct case)
    few_big = verdict([0.0] * 3 + [50.0] * 27, [100.0] * 3 + [45.0] * 27, 0.5)
    assert few_big.mixed_score > few_big.global_score and (few_big.wins, few_big.losses) == (3, 27)
    assert few_big.gain == 0.0 and few_big.p_value > 0.99
    # 20 better, 10 worse of 30: one-sided sign test p = P(Bin(30, 1/2) >= 20), by hand
    from math import comb
    p = sum(comb(30, k) for k in range(20, 31)) / 2 ** 30
    close = verdict([50.0] * 30, [60.0] * 20 + [40.0] * 10, 0.5)
    assert close.p_value == pytest.approx(p) and p < 0.05 and close.gain == 1.0
    # 19 of 30 is not enough at 0.05
    assert verdict([50.0] * 30, [60.0] * 19 + [40.0] * 11, 0.5).gain == 0.0
    # many wins but a lower mean (one disaster): closed
    assert verdict([50.0] * 30, [51.0] * 29 + [0.0], 0.5).gain == 0.0
    # every answer tied: no evidence, p = 1
    tied = verdict([30.0] * 4, [30.0] * 4, 0.5)
    assert tied.gain == 0.0 and tied.p_value == 1.0 and (tied.wins, tied.losses) == (0, 0)
    with pytest.raises(ValueError, match="aligned"):
        verdict([1.0], [1.0, 2.0], 0.5)
    with pytest.raises(ValueError, match="aligned"):
        verdict([], [], 0.5)
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="level"):
            verdict([1.0], [2.0], 0.5, alpha=bad)


def test_a_tie_closes_the_gate_and_bad_arguments_are_refused(rt: Runtime) -> None:
    local = rt.get("local")
    try:
        rt.set("local", rt.get("global"))  # the mix is the global adapter: the same answers
        asked = list(generate_suite(n_train=3, n_test=1, families=["capitals"]).clients[0].train)
        tie = check(rt, asked, 0.5, max_new_tokens=TOKENS)
        assert tie.global_score == tie.mixed_score and tie.gain == 0.0  # no evidence that the local adapter helps
    finally:
        rt.set("local", local)
    with pytest.raises(ValueError, match="held-out"):
        check(rt, [], 0.5)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            check(rt, asked, bad)


def test_training_with_a_hold_out_stores_each_clients_gate(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", "--method", "feddpa-t", "--data", "generated", "--n-train", "6", "--n-test", "2",
                 "--families", "sorting,capitals", "--rounds", "2", "--out", str(out), "--model", "tiny",
                 "--preset", "tiny", "--hold-out", "0.34"]) == 0
    printed = capsys.readouterr().out
    assert "local adapters kept by the hold-out check:" in printed and "on 2 held-out examples" in printed
    run = RunDir(out)
    assert run.read_config()["data_options"]["hold_out"] == 0.34
    for client in run.clients():
        cal = Calibration.load(run.client_dir(client))
        assert cal is not None and cal.summary["n_instances"] == 4  # the index holds the 4 trained-on examples
        assert cal.gate["n"] == 2 and cal.gate["lambda"] == 0.5 and cal.gain == cal.gate["gain"]
        assert json.loads((run.client_dir(client) / CALIBRATION_FILE).read_text())["format"] == 3
    # `fedmosaic calibrate` rebuilds the calibration and keeps the verdict on the adapters
    first = run.clients()[0]
    path = run.client_dir(first) / CALIBRATION_FILE
    data = json.loads(path.read_text())
    data["gain"], data["gate"]["gain"] = 0.0, 0.0
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["calibrate", str(out), "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)[first]["gain"] == 0.0
    again = Calibration.load(run.client_dir(first))
    assert again is not None and again.gain == 0.0 and again.gate["gain"] == 0.0
    # `--gate` checks the local adapters again: the same held-out examples, the stored verdict restored
    assert main(["calibrate", str(out), "--dtype", "float32", "--gate"]) == 0
    checked = json.loads(capsys.readouterr().out)
    for client in run.clients():
        cal = Calibration.load(run.client_dir(client))
        assert cal is not None and checked[client]["gate"] == cal.gate and cal.gate["n"] == 2
        assert "p_value" in cal.gate and cal.gain == cal.gate["gain"]
    assert checked[first]["gain"] == checked[first]["gate"]["gain"]
    before = {c: (run.client_dir(c) / "embeddings.calibration.json").read_bytes() for c in run.clients()}
    for bad, message in ((["--gate", "--gate-alpha", "1.5"], "gate-alpha must be in"),
                         (["--gate-alpha", "0.1"], "add --gate")):  # a level without the check: refused, not ignored
        with pytest.raises(SystemExit, match=message):
            main(["calibrate", str(out), *bad])
    assert before == {c: (run.client_dir(c) / "embeddings.calibration.json").read_bytes() for c in run.clients()}
    with pytest.raises(SystemExit, match="hold-out"):
        main(["train", "--method", "feddpa-t", "--data", "generated", "--out", str(tmp_path / "x"), "--model", "tiny",
              "--hold-out", "0.9"])
