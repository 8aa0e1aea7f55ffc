"""FedDPA's inference ablations from the command line: similarity (paper 000 Table 9), the reference
code's variant, the mean-token embedding (Table 10), on ``eval``, ``serve``, ``batch`` and ``calibrate``."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from adapters.rundir import RunDir
from fedmosaic.cli import main
from models import tiny_tokenizer
from routing.base import RoutingError
from routing.cache import IndexCache, index_pooling
from routing.calibration import Calibration, fingerprint
from routing.feddpa import FedDPARouter
from routing.feddpa_options import FedDPAOptions
from routing.instance import InstanceWeightRouter
from serving.cli import add_serve_arguments, settings_from_args
from serving.stack import stack_config
from training.data import load_run_dataset
from training.federation.personalize import instance_prompts

TRAIN = ["train", "--method", "feddpa-t", "--data", "generated", "--n-train", "4", "--n-test", "1",
         "--families", "sorting,capitals", "--rounds", "2", "--model", "tiny", "--preset", "tiny"]
EVAL = ["--limit", "1", "--max-new-tokens", "2", "--dtype", "float32"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    out = tmp_path_factory.mktemp("ablate") / "run"
    assert main([*TRAIN, "--out", str(out)]) == 0
    return RunDir(out)


def copy(run: RunDir, dest: Path) -> RunDir:
    shutil.copytree(run.root, dest)
    return RunDir(dest)


def routed(run: RunDir) -> list[dict]:
    """Every routed row of the evaluation's prediction cache just written (its route info and weights)."""
    results = json.loads((run.eval_dir / "results.json").read_text())
    tags = {json.dumps(t, sort_keys=True, default=str) for t in results["targets"].values()}
    rows = [json.loads(x) for f in sorted((run.eval_dir / "predictions").rglob("*.jsonl"))
            for x in f.read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("route", {}).get("source") == "instance" and r.get("tag") in tags]


def evaluate(run: RunDir, *options: str) -> list[dict]:
    assert main(["eval", str(run.root), *EVAL, *options]) == 0
    rows = routed(run)
    assert rows, "no routed <client> answer was evaluated"
    return rows


def by_example(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Rows by (prompt, the client's local adapter): every client answers every task's prompts."""
    return {(r["prompt"], next(k for k in r["weights"] if k.endswith(":local"))): r for r in rows}


def test_similarity_changes_a_on_the_same_requests(run: RunDir) -> None:
    cosine = by_example(evaluate(run, "--feddpa-weighting", "paper"))
    pearson = by_example(evaluate(run, "--feddpa-similarity", "pearson"))  # no weighting given: the paper's
    neg_l2 = by_example(evaluate(run, "--feddpa-similarity", "neg-l2"))
    assert set(cosine) == set(pearson) == set(neg_l2)
    for key, row in cosine.items():
        p, n = pearson[key]["route"], neg_l2[key]["route"]
        assert row["route"]["weighting"] == p["weighting"] == n["weighting"] == "paper"
        assert "similarity" not in row["route"] and p["similarity"] == "pearson" and n["similarity"] == "neg_l2"
        assert p["mean_similarity"] != pytest.approx(row["route"]["mean_similarity"], abs=1e-6)
        assert n["mean_similarity"] < 0  # minus a distance: clipped to a = 0, the base weights all global
        assert n["a"] == 0.0
    described = json.loads((run.eval_dir / "results.json").read_text())["targets"]
    assert {d["routing"]["feddpa_similarity"] for d in described.values() if d.get("routed")} == {"neg_l2"}


def test_reference_variant_gives_a_to_the_global_adapter(run: RunDir) -> None:
    paper = by_example(evaluate(run, "--feddpa-weighting", "paper"))
    reference = by_example(evaluate(run, "--feddpa-variant", "reference"))
    assert set(paper) == set(reference)
    for (prompt, local), row in reference.items():
        a = row["route"]["a"]
        assert row["route"]["variant"] == "reference" and a == pytest.approx(paper[prompt, local]["route"]["a"])
        assert row["weights"] == pytest.approx({"global": a, local: 1 - a})
        assert paper[prompt, local]["weights"] == pytest.approx({"global": 1 - a, local: a})


def test_calibrated_weighting_with_an_ablation_is_refused(run: RunDir) -> None:
    with pytest.raises(SystemExit, match="calibrated FedDPA weighting is defined for cosine"):
        main(["eval", str(run.root), *EVAL, "--feddpa-weighting", "calibrated", "--feddpa-similarity", "pearson"])
    with pytest.raises(SystemExit, match="variant 'reference'.*--feddpa-weighting paper"):
        main(["serve", str(run.root), "--model", "tiny", "--feddpa-weighting", "calibrated",
              "--feddpa-variant", "reference"])
    with pytest.raises(RoutingError, match="calibrated"):
        FedDPARouter(weighting="calibrated", similarity="neg_l2")
    # the mean embedding composes with the calibration (computed from the index's own vectors)
    assert FedDPARouter(weighting="calibrated", embedding="mean").embedding == "mean"


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_environment_reaches_the_settings_and_options_win(run: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_SIMILARITY", "neg-l2")
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_VARIANT", "reference")
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_EMBEDDING", "mean")
    settings = settings_from_args(parse_serve([str(run.root)]))  # options left out never override the env
    assert (settings.feddpa_similarity, settings.feddpa_variant, settings.feddpa_embedding) == \
        ("neg_l2", "reference", "mean")
    config = stack_config(settings)
    assert (config.feddpa.similarity, config.feddpa.variant, config.feddpa.embedding) == ("neg_l2", "reference", "mean")
    assert (config.feddpa.instance, config.feddpa.rule) == (True, "paper")  # an ablation: the paper's rule
    given = settings_from_args(parse_serve([str(run.root), "--feddpa-similarity", "pearson", "--feddpa-variant",
                                            "paper", "--feddpa-embedding", "last"]))
    assert (given.feddpa_similarity, given.feddpa_variant, given.feddpa_embedding) == ("pearson", "paper", "last")
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_WEIGHTING", "calibrated")
    with pytest.raises(SystemExit, match="calibrated FedDPA weighting"):
        settings_from_args(parse_serve([str(run.root)]))
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_SIMILARITY", "euclid")
    with pytest.raises(SystemExit, match="neg-l2"):
        settings_from_args(parse_serve([str(run.root)]))


def test_mean_embedding_refused_on_a_last_token_index_then_rebuilt_by_calibrate(
        run: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    mean = copy(run, tmp_path / "mean")
    clients = mean.clients()
    before = {c: np.load(mean.embeddings(c)) for c in clients}
    assert {index_pooling(mean.client_dir(c)) for c in clients} == {"last"}
    fix = f"fedmosaic calibrate {mean.root} --feddpa-embedding mean"
    with pytest.raises(SystemExit, match=re.escape(f"holds 'last' embeddings; rebuild it with `{fix}`")):
        main(["eval", str(mean.root), *EVAL, "--feddpa-embedding", "mean"])
    with pytest.raises(SystemExit, match="fedmosaic serve: .*fedmosaic calibrate"):
        main(["serve", str(mean.root), "--model", "tiny", "--feddpa-embedding", "mean"])
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"model": clients[0], "prompt": "Hi", "max_tokens": 1}) + "\n")
    with pytest.raises(SystemExit, match="fedmosaic batch: .*fedmosaic calibrate"):
        main(["batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), str(mean.root), "--model", "tiny",
              "--backend", "torch", "--no-progress", "--feddpa-embedding", "mean"])

    capsys.readouterr()
    assert main(["calibrate", str(mean.root), "--feddpa-embedding", "mean", "--dtype", "float32"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {c: (p["embedding"], p["rebuilt"]) for c, p in printed.items()} == {c: ("mean", True) for c in clients}
    for c in clients:
        vectors = np.load(mean.embeddings(c))
        assert index_pooling(mean.client_dir(c)) == "mean"
        assert vectors.shape == before[c].shape  # the same instances (the run's data set, as run.json records it)
        assert not np.allclose(vectors, before[c], atol=1e-3)  # pooled otherwise
        cal = Calibration.load(mean.client_dir(c))
        assert cal is not None and cal.fingerprint == fingerprint(vectors)
    # the index as asked: kept (only recalibrated) unless --rebuild-index
    assert main(["calibrate", str(mean.root), "--feddpa-embedding", "mean", "--dtype", "float32"]) == 0
    assert {p["rebuilt"] for p in json.loads(capsys.readouterr().out).values()} == {False}
    assert main(["calibrate", str(mean.root), "--rebuild-index", "--dtype", "float32"]) == 0
    assert {(p["embedding"], p["rebuilt"]) for p in json.loads(capsys.readouterr().out).values()} == {("mean", True)}

    rows = evaluate(mean, "--feddpa-embedding", "mean")  # the default (calibrated) rule composes with it
    assert {(r["route"]["weighting"], r["route"]["embedding"]) for r in rows} == {("calibrated", "mean")}
    with pytest.raises(SystemExit, match="holds 'mean' embeddings.*--feddpa-embedding last"):
        main(["eval", str(mean.root), *EVAL])  # and the paper's last token is refused on it

    # serving pools the prompt as the index did, across prefill chunks: a training prompt finds itself
    cfg = mean.read_config()
    client = clients[0]
    prompt = instance_prompts(next(c for c in load_run_dataset(cfg).clients if c.client_id == client),
                              tiny_tokenizer(), str(cfg["train"]["prompt_style"]))[0]
    assert len(tiny_tokenizer()(prompt)["input_ids"]) > 8  # more than two chunks of 4 tokens
    monkeypatch.setenv("FEDMOSAIC_SERVE_MAX_PREFILL_TOKENS", "4")
    src.write_text(json.dumps({"model": client, "prompt": prompt, "max_tokens": 1, "temperature": 0}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["batch", "-i", str(src), "-o", str(out), str(mean.root), "--model", "tiny", "--dtype", "float32",
                 "--backend", "torch", "--no-progress", "--feddpa-embedding", "mean",
                 "--feddpa-weighting", "paper"]) == 0
    info = json.loads(out.read_text())["response"]["body"]["fedmosaic"]["info"]
    assert info["embedding"] == "mean"
    stored = IndexCache.for_run(mean.root).get(client)
    cosines = stored.unit @ stored.unit[0]
    assert info["mean_similarity"] == pytest.approx(float(np.mean(cosines)), abs=1e-4)


def test_a_request_reads_only_its_own_clients_index(run: RunDir, tmp_path: Path) -> None:
    mixed = copy(run, tmp_path / "mixed")
    a, b = mixed.clients()
    assert main(["calibrate", str(mixed.root), "--feddpa-embedding", "mean", "--dtype", "float32"]) == 0
    shutil.copytree(run.client_dir(b), mixed.client_dir(b), dirs_exist_ok=True)  # b: back to last-token
    (mixed.client_dir(b) / "embeddings.kind.json").unlink(missing_ok=True)  # an index from before the record
    with pytest.raises(RoutingError, match=rf"clients \['{b}'\] holds 'last'"):
        InstanceWeightRouter.for_run(mixed.root, lambda_=0.5,
                                     options=FedDPAOptions(weighting="paper", embedding="mean"))
    # past the start-up check (an index swapped while serving), each request still reads its client's files only
    router = InstanceWeightRouter(FedDPARouter(lambda_=0.5, embedding="mean"), IndexCache.for_run(mixed.root))
    state = torch.randn(np.load(mixed.embeddings(a)).shape[1])
    assert router(a, state).info["embedding"] == "mean"
    assert [k[0] for k in router.cache.keys()] == [a]
    with pytest.raises(RoutingError, match=f"client '{b}'.*holds 'last'"):
        router(b, state)


def test_serve_routes_with_the_options_given_on_its_command_line(run: RunDir) -> None:
    import time

    from fastapi.testclient import TestClient

    from serving.api.app import create_app

    settings = settings_from_args(parse_serve([str(run.root), "--model", "tiny", "--routing-details", "all",
                                               "--feddpa-similarity", "pearson", "--feddpa-variant", "reference"]))
    client = run.clients()[0]
    with TestClient(create_app(settings)) as http:
        for _ in range(300):
            if http.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        body = http.post("/v1/chat/completions", json={
            "model": client, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Sort these words alphabetically: pear, apple"}]}).json()
    info, weights = body["fedmosaic"]["info"], body["fedmosaic"]["weights"]
    assert (info["weighting"], info["similarity"], info["variant"]) == ("paper", "pearson", "reference")
    assert weights == pytest.approx({"global": info["a"], f"{client}:local": 1 - info["a"]})
