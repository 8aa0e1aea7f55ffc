"""End-to-end ``fedmosaic eval`` on a run directory built here (tiny model, random adapters).

Generation goes through the serving stack by served target; the engine path must equal the HF
``generate`` path (greedy), FedDPA runs are evaluated with instance-wise weights (recorded per example
and plotted) or the fixed weight, and the prediction cache resumes and invalidates correctly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from adapters import LoraConfig, inject, load_adapter, save_adapter
from adapters.rundir import RunDir
from fedmosaic.cli import main
from fedmosaic.evaluation.backend import EvalItem
from fedmosaic.evaluation.evaluate import EvalOptions, evaluate_run, served_targets
from fedmosaic.evaluation.predictions import Prediction
from fedmosaic.evaluation.stack_backend import StackBackend, feddpa_routing, open_backend
from models import save_tiny_llama, tiny_llama
from routing.cache import EmbeddingIndex
from routing.embedding import embed_prompts
from serving.beam import GenerationConfig, generate_target
from serving.errors import InvalidRequest

DATA = {"n_train": 4, "n_test": 3, "families": ["sorting", "capitals"]}


def build_run(root: Path, method: str = "FedDPA-T", embeddings: bool = False, style: str = "alpaca_short") -> RunDir:
    model_dir = save_tiny_llama(root / "model")
    run = RunDir(root / "run")
    run.root.mkdir(parents=True)
    run.run_json.write_text(json.dumps({"method": method, "data": "generated", "data_options": DATA,
                                        "model": str(model_dir), "inference_weight": 0.5,
                                        "train": {"prompt_style": style}}))
    adapted = inject(tiny_llama().model)
    gen = torch.Generator().manual_seed(0)
    for name, folder in (("g", run.global_adapter), ("l0", run.local_adapter("sorting")),
                         ("l1", run.local_adapter("capitals")), ("r1", run.round_dir(1) / "global")):
        adapted.add_adapter(name, LoraConfig(r=4), seed=len(name))
        for _, layer in adapted.adapter_layers(name):
            with torch.no_grad():
                layer.adapters[name].lora_B.copy_(torch.randn(layer.adapters[name].lora_B.shape, generator=gen))
        save_adapter(adapted, name, folder)
    if embeddings:  # as training writes them: local prompts' last-token states with the global adapter on
        tiny = tiny_llama()
        model = inject(tiny.model)
        load_adapter(model, run.global_adapter, "global", check_base=False)
        for c, train in (("sorting", ["Sort: b, a", "Sort: kiwi, fig, date"]), ("capitals", ["Capital of Chad?"])):
            vecs = embed_prompts(tiny.model, model, tiny.tokenizer, train, ("global",))
            EmbeddingIndex(vecs).save(run.client_dir(c))
    return run


class Spy:
    """Wraps the real backend and counts the examples it generates."""

    def __init__(self, inner: StackBackend) -> None:
        self.inner, self.base_name, self.calls = inner, inner.base_name, 0

    def __getattr__(self, name: str):  # delegate models/describe/add_adapter/remove_adapter
        return getattr(self.inner, name)

    def generate(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, Prediction]]:
        for item, pred in self.inner.generate(items):
            self.calls += 1
            yield item, pred


def test_evaluate_run_writes_tables_json_and_plots(tmp_path: Path) -> None:
    run = build_run(tmp_path)
    opts = EvalOptions(limit=2, max_new_tokens=3, batch_size=2, per_round=True, dtype="float32")
    summary = evaluate_run(run.root, opts)
    assert summary["clients"] == ["sorting", "capitals"]
    assert set(summary["scores"]) == {"sorting", "capitals", "global", "base"}
    assert summary["scores"]["base"]["sorting"]["n"] == 2
    assert summary["answers"] == {"generated": 4 * 2 * 2, "cached": 0}  # 4 targets x 2 tasks x 2 examples
    # no embedding index: the personalised model is the fixed (0.5, 0.5) mix, and nothing to plot
    assert summary["targets"]["sorting"]["weights"] == [0.5, 0.5] and "feddpa_weights" not in summary
    md = (run.eval_dir / "table.md").read_text()
    assert "Personalization" in md and "| FedDPA-T |" in md and "| FedDPA-T [base] |" in md
    saved = json.loads((run.eval_dir / "results.json").read_text())
    assert saved["tables"]["personalization"][0]["label"] == "FedDPA-T" and "1" in saved["per_round"]
    for png in ("scores.png", "rounds.png"):
        assert (run.eval_dir / png).read_bytes()[:4] == b"\x89PNG"
    lines = (run.eval_dir / "predictions" / "final" / "sorting" / "capitals.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    assert len(lines) == 2 and {"prompt", "prediction", "reference", "tag"} <= set(row)
    assert row["weights"] == {"global": 0.5, "sorting:local": 0.5}

    spy = Spy(open_backend(run, run.read_config(), dtype="float32", max_new_tokens=3, batch_size=2))
    again = evaluate_run(run.root, opts, backend=spy)
    assert again["scores"] == summary["scores"] and again["answers"] == {"generated": 0, "cached": 16}
    assert spy.calls == 0  # everything cached: nothing regenerated
    spy.inner.max_new_tokens = 4  # another decoding setting: the tags differ, every example is redone
    other = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=4, batch_size=2, dtype="float32"), backend=spy)
    # (2 clients + global + base) x 2 tasks x 1 example
    assert spy.calls == 4 * 2 and other["answers"] == {"generated": 8, "cached": 0}
    assert main(["eval", str(run.root), str(run.root), "--compare", "--out", str(tmp_path / "cmp.md")]) == 0
    assert (tmp_path / "cmp.md").read_text().count("| FedDPA-T |") == 4  # two runs x two blocks


def test_engine_path_equals_hf_generate_path(tmp_path: Path) -> None:
    run = build_run(tmp_path, embeddings=True)
    # knn: the S nearest instances, so a routed weight does not depend on the order of the requests
    backend = open_backend(run, run.read_config(), dtype="float32", max_new_tokens=6, batch_size=3, mode="knn")
    assert backend.stack.routing == "instance"
    targets = served_targets(backend.models(), backend.base_name, ["sorting", "capitals", "absent"])
    # a client without a local adapter is served the global model (FedIT-style)
    assert targets == {"sorting": "sorting", "capitals": "capitals", "absent": "global", "global": "global",
                       "base": backend.base_name}
    prompts = ["Sort: pear, apple, fig", "Capital of Peru?", "twelve plus seven", "Convert 5 km to m", "Hi"]
    for target in ("sorting", "capitals:local", "global", backend.base_name):
        items = [EvalItem("final", target, "t", i, target, p, "", "") for i, p in enumerate(prompts)]
        engine = {item.i: pred for item, pred in backend.generate(items)}
        hf = generate_target(backend.stack, target, prompts, GenerationConfig(max_new_tokens=6, batch_size=3))
        assert [engine[i].text for i in range(len(prompts))] == [c.text for c in hf]
        for i, c in enumerate(hf):  # the same routed weights, per example
            assert engine[i].extra.get("weights", {}) == pytest.approx(c.weights)
    routed = [pred for _, pred in backend.generate(
        [EvalItem("final", "sorting", "t", i, "sorting", p, "", "") for i, p in enumerate(prompts)])]
    a = [r.extra["weights"]["sorting:local"] for r in routed]
    assert len(set(a)) > 1  # instance-wise: a differs per example
    for r in routed:
        route = r.extra["route"]
        assert route["source"] == "instance" and route["a"] == pytest.approx(
            min(1.0, max(0.0, 0.5 * route["mean_similarity"])), abs=1e-6)


def test_feddpa_weights_recorded_and_plotted_or_fixed_on_request(tmp_path: Path) -> None:
    run = build_run(tmp_path, embeddings=True, style="chat")  # prompts in the template the run trained with
    opts = EvalOptions(limit=2, max_new_tokens=2, batch_size=4, dtype="float32", feddpa_samples=3)
    summary = evaluate_run(run.root, opts)
    target = summary["targets"]["sorting"]
    assert target["routed"] and target["routing"]["routing"] == "instance"
    weights = summary["feddpa_weights"]
    assert weights["per_task_own_client"]["sorting"]["n"] == 2
    assert weights["per_task_other_clients"]["sorting"]["n"] == 2
    assert set(weights["per_client"]) == {"sorting", "capitals"}
    assert (run.eval_dir / "feddpa_weights.png").read_bytes()[:4] == b"\x89PNG"
    rows = run.eval_dir / "predictions" / "final" / "capitals" / "sorting.jsonl"
    row = json.loads(rows.read_text().splitlines()[0])
    assert row["prompt"].startswith("<|im_start|>user") and row["weights"]["capitals:local"] == pytest.approx(
        row["route"]["a"])
    assert row["route"]["S_requested"] == 3 and row["route"]["S"] == 1  # capitals stored one instance
    assert sum(row["weights"].values()) == pytest.approx(1.0)
    fixed = evaluate_run(run.root, EvalOptions(limit=2, max_new_tokens=2, dtype="float32", feddpa_weights="fixed"))
    assert not fixed["targets"]["sorting"]["routed"] and "feddpa_weights" not in fixed
    row = json.loads(rows.read_text().splitlines()[-1])
    assert row["weights"] == {"global": 0.5, "capitals:local": 0.5}  # the routed rows were not reused


def test_beam_search_and_option_errors(tmp_path: Path) -> None:
    run = build_run(tmp_path, method="fedlora", embeddings=True)
    backend = open_backend(run, run.read_config(), dtype="float32", max_new_tokens=3, num_beams=2, batch_size=2)
    assert backend.stack.routing == "fixed"  # auto: instance-wise weighting is FedDPA's, not FedLoRA's
    items = [EvalItem("final", "sorting", "t", i, "sorting", p, "", "") for i, p in enumerate(["a b", "c"])]
    out = dict(backend.generate(items))
    assert len(out) == 2 and all(p.extra["weights"] == {"global": 0.5, "sorting:local": 0.5} for p in out.values())
    assert backend.describe("sorting")["decoding"] == "beams=2"
    bare = build_run(tmp_path / "bare")
    with pytest.raises(ValueError, match="embedding index"):
        open_backend(bare, bare.read_config(), weighting="instance")
    with pytest.raises(ValueError, match="feddpa_weights"):
        EvalOptions(feddpa_weights="sometimes")


def test_auto_weighting_follows_the_method_registry(tmp_path: Path) -> None:
    from training.algorithms import ALGORITHMS

    run = build_run(tmp_path, embeddings=True)
    for name, method in ALGORITHMS.items():
        expected = "instance" if method.instance_weighting else "fixed"
        assert feddpa_routing({"method": name.upper()}, run, "auto") == expected, name
    assert {n for n, m in ALGORITHMS.items() if m.instance_weighting} == {"feddpa-t", "feddpa-f"}
    assert feddpa_routing({"method": "feddpa-x"}, run, "auto") == "fixed"  # not registered: no instance weights
    assert feddpa_routing({}, run, "fixed") == "fixed"
    bare = build_run(tmp_path / "bare")
    assert feddpa_routing({"method": "feddpa-t"}, bare, "auto") == "fixed"  # no embedding index


def test_amole_run_is_evaluated_through_the_same_targets(tmp_path: Path) -> None:
    from adapters.amole_io import save_amole
    from adapters.amole_layer import add_amole_experts

    model_dir = save_tiny_llama(tmp_path / "model")
    run = RunDir(tmp_path / "run")
    adapted = inject(tiny_llama().model)
    add_amole_experts(adapted, 4, LoraConfig(r=4, alpha=8.0, dropout=0.0), seed=0)
    assignments = {"sorting": {p: [0, 1] for p in adapted.layers}, "capitals": {p: [2, 3] for p in adapted.layers}}
    save_amole(adapted, run.amole, 4, assignments, top_k=1)
    run.run_json.write_text(json.dumps({"method": "fedamole", "data": "generated", "data_options": DATA,
                                        "model": str(model_dir)}))
    summary = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, dtype="float32"))
    assert summary["targets"]["sorting"]["mode"] == "amole" and set(summary["scores"]) == {"sorting", "capitals",
                                                                                           "base"}
    row = json.loads((run.eval_dir / "predictions" / "final" / "capitals" / "sorting.jsonl").read_text())
    assert "expert_usage" in row["route"]  # the engine's per-token routing report is kept with the answer
    with pytest.raises(InvalidRequest, match="beam search"):
        evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, num_beams=2, dtype="float32"))


def test_each_target_decodes_in_its_own_stream(tmp_path: Path) -> None:
    """A target's rows never share decode steps with another target's, so its answers do not depend on them."""
    run = build_run(tmp_path, embeddings=True)
    backend = open_backend(run, run.read_config(), dtype="bfloat16", max_new_tokens=5, batch_size=3, mode="knn")
    streams: list[set[str]] = []
    real_run = backend.stack.run

    def recording_run(jobs, window=None):  # the real ServingStack.run, watched
        seen: set[str] = set()
        streams.append(seen)
        yield from real_run((seen.add(job.target) or job for job in jobs), window)

    backend.stack.run = recording_run  # type: ignore[method-assign]
    prompts = ["Sort: pear, apple, fig", "Capital of Peru?", "twelve plus seven", "Convert 5 km to m"]
    targets = ("sorting", backend.base_name, "global", "capitals")
    mixed = [EvalItem("final", t, "t", i, t, p, "", "") for i, p in enumerate(prompts) for t in targets]
    together = {(item.target, item.i): pred.text for item, pred in backend.generate(mixed)}
    assert streams == [{t} for t in targets]  # one stream per target, in first-seen order
    for t in targets:  # the same answers as when the target is evaluated on its own
        alone = {item.i: pred.text for item, pred in backend.generate([it for it in mixed if it.target == t])}
        assert alone == {i: together[(t, i)] for i in range(len(prompts))}


def test_a_closed_gate_serves_the_global_alone_and_the_weights_before_it_are_plotted(tmp_path: Path) -> None:
    from fedmosaic.calibrate_cli import calibrate_run
    from routing.calibration import CALIBRATION_FILE

    run = build_run(tmp_path, embeddings=True, style="chat")
    opts = EvalOptions(limit=2, max_new_tokens=2, dtype="float32", feddpa_weighting="fixed")
    evaluate_run(run.root, opts)
    folder = run.eval_dir / "predictions" / "final" / "sorting"
    rows = {task: folder / f"{task}.jsonl" for task in ("sorting", "capitals")}
    asked = [json.loads(line)["prompt"] for line in rows["sorting"].read_text().splitlines()]
    tiny = tiny_llama()
    model = inject(tiny.model)
    load_adapter(model, run.global_adapter, "global", check_base=False)
    for client, prompts in (("sorting", asked * 3), ("capitals", ["Capital of Chad?", "Capital of Peru?"])):
        # sorting's index holds the evaluation's own prompts, so they score as its own instances
        vectors = embed_prompts(tiny.model, model, tiny.tokenizer, prompts, ("global",))
        EmbeddingIndex(vectors).save(run.client_dir(client))
    calibrate_run(run.root, dtype="float32")
    path = run.client_dir("sorting") / CALIBRATION_FILE
    data = json.loads(path.read_text())
    data["gain"], data["gate"] = 0.0, {"metric": "rouge1", "lambda": 0.5, "global": 40.0, "mixed": 30.0, "n": 3,
                                       "gain": 0.0}
    path.write_text(json.dumps(data))
    calibrated = EvalOptions(limit=2, max_new_tokens=2, dtype="float32", feddpa_weighting="calibrated")
    summary = evaluate_run(run.root, calibrated)
    served, before = summary["feddpa_weights"], summary["feddpa_weights"]["before_gate"]
    assert served["per_client"]["sorting"] == {"sorting": 0.0, "capitals": 0.0}  # its gate closed
    assert before["per_client"]["capitals"] == served["per_client"]["capitals"]  # its gate is open
    own = [json.loads(line)["route"] for line in rows["sorting"].read_text().splitlines()[-2:]]  # rows append
    assert all(r["gain"] == 0.0 and r["a"] == 0.0 for r in own)
    ungated = sum(r["a_before_gate"] for r in own) / len(own)
    assert ungated > 0.0  # the estimator knows its own prompts
    assert before["per_task_own_client"]["sorting"]["mean"] == pytest.approx(ungated)
    assert (run.eval_dir / "feddpa_weights_before_gate.png").read_bytes()[:4] == b"\x89PNG"
    # the gate reopened: the cached answers of the closed one are not reused, and no second plot
    data["gain"] = 1.0
    path.write_text(json.dumps(data))
    (run.eval_dir / "feddpa_weights_before_gate.png").unlink()
    again = evaluate_run(run.root, calibrated)
    assert "before_gate" not in again["feddpa_weights"]
    assert again["feddpa_weights"]["per_client"]["sorting"]["sorting"] == pytest.approx(
        before["per_client"]["sorting"]["sorting"])
    assert not (run.eval_dir / "feddpa_weights_before_gate.png").exists()


class Recorder(Spy):
    """A :class:`Spy` that also records (key, task, index) of every generated example."""

    def __init__(self, inner: StackBackend) -> None:
        super().__init__(inner)
        self.done: list[tuple[str, str, int]] = []

    def generate(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, Prediction]]:
        for item, pred in super().generate(items):
            self.done.append((item.key, item.task, item.i))
            yield item, pred


def test_ttp_limit_cuts_only_a_clients_off_task_examples(tmp_path: Path) -> None:
    run = build_run(tmp_path)  # clients sorting and capitals, 3 test examples per task
    spy = Recorder(open_backend(run, run.read_config(), dtype="float32", max_new_tokens=2, batch_size=2))
    opts = EvalOptions(ttp_limit=1, max_new_tokens=2, batch_size=2, dtype="float32")
    summary = evaluate_run(run.root, opts, backend=spy)
    per_job: dict[tuple[str, str], list[int]] = {}
    for key, task, i in spy.done:
        per_job.setdefault((key, task), []).append(i)
    assert {k: sorted(v) for k, v in per_job.items()} == {
        ("sorting", "sorting"): [0, 1, 2], ("sorting", "capitals"): [0],
        ("capitals", "capitals"): [0, 1, 2], ("capitals", "sorting"): [0],
        ("global", "sorting"): [0, 1, 2], ("global", "capitals"): [0, 1, 2],
        ("base", "sorting"): [0, 1, 2], ("base", "capitals"): [0, 1, 2]}
    assert summary["scores"]["sorting"]["capitals"]["n"] == 1 and summary["scores"]["sorting"]["sorting"]["n"] == 3
    assert summary["options"]["ttp_limit"] == 1 and "first 1 examples of each task" in summary["markdown"]
    # TTP compares every model on the same examples (the first of each task), Personalization on all three
    ttp = {r["label"]: r["avg"] for r in summary["tables"]["ttp"]}
    for key in ("sorting", "global", "base"):
        assert all(summary["ttp_scores"][key][t]["n"] == 1 for t in ("sorting", "capitals"))
    own_first = [summary["ttp_scores"][c][c]["rouge1"] for c in ("sorting", "capitals")]
    cut = summary["ttp_scores"]
    other = [cut["sorting"]["capitals"]["rouge1"], cut["capitals"]["sorting"]["rouge1"]]
    assert ttp["FedDPA-T"] == pytest.approx((sum(own_first) + sum(other)) / 4)
    glob = summary["ttp_scores"]["global"]
    assert ttp["FedDPA-T [global]"] == pytest.approx((glob["sorting"]["rouge1"] + glob["capitals"]["rouge1"]) / 2)
    # each client's per-example scores behind its cells, in test order, for paired comparisons between runs
    from training.scoring import example_scores

    ex = summary["example_scores"]
    assert ex["metric"] == "rouge1" and set(ex["personalization"]) == {"sorting", "capitals"}
    for c in ("sorting", "capitals"):
        cached = [json.loads(x) for x in (run.eval_dir / "predictions" / "final" / c / f"{c}.jsonl").read_text()
                  .splitlines()]
        assert ex["personalization"][c] == [round(example_scores(r["prediction"], r["reference"])["rouge1"], 4)
                                           for r in sorted(cached, key=lambda r: r["i"])]
        assert sum(ex["personalization"][c]) / 3 == pytest.approx(summary["scores"][c][c]["rouge1"], abs=1e-4)
        assert {t: len(v) for t, v in ex["ttp"][c].items()} == {"sorting": 1, "capitals": 1}
        for t, v in ex["ttp"][c].items():
            assert v[0] == pytest.approx(cut[c][t]["rouge1"], abs=1e-4)
    from fedmosaic.evaluation.compare import compare_runs

    # --compare reads the TTP scores on the cut examples, as the run's own table does
    path = run.eval_dir / "results.json"
    saved = json.loads(path.read_text())
    for by_task in saved["ttp_scores"].values():
        for entry in by_task.values():
            entry["rouge1"] = 12.5  # unlike every full-grid score, so the block shows which grid it read
    path.write_text(json.dumps(saved))
    side = compare_runs([run.root])
    row = next(line for line in side.split("Test-Time Personalization", 1)[1].splitlines()
               if line.startswith("| FedDPA-T |"))
    assert row.rstrip(" |").endswith("12.50")
    # the full evaluation afterwards generates only what the cut one skipped, and its TTP uses every example
    spy.done.clear()
    full = evaluate_run(run.root, EvalOptions(max_new_tokens=2, batch_size=2, dtype="float32"), backend=spy)
    assert sorted(spy.done) == sorted([("sorting", "capitals", 1), ("sorting", "capitals", 2),
                                       ("capitals", "sorting", 1), ("capitals", "sorting", 2)])
    assert full["scores"]["sorting"]["capitals"]["n"] == 3
    assert all(len(v) == 3 for tasks in full["example_scores"]["ttp"].values() for v in tasks.values())
    with pytest.raises(ValueError, match="ttp_limit must be >= 1"):
        EvalOptions(ttp_limit=0)


def test_ttp_limit_keeps_a_shared_model_in_full_where_a_client_needs_it(tmp_path: Path) -> None:
    run = build_run(tmp_path, method="FedIT")
    for c in ("sorting", "capitals"):  # FedIT: every client is served the global model
        for path in run.local_adapter(c).iterdir():
            path.unlink()
        run.local_adapter(c).rmdir()
    spy = Recorder(open_backend(run, run.read_config(), dtype="float32", max_new_tokens=2, batch_size=2))
    summary = evaluate_run(run.root, EvalOptions(ttp_limit=1, max_new_tokens=2, batch_size=2, dtype="float32"),
                           backend=spy)
    assert summary["targets"]["sorting"]["target"] == summary["targets"]["capitals"]["target"]
    # one generation per example of the shared target, every example of both tasks (each is someone's own)
    assert len(spy.done) == len(set(spy.done)) and {(t, i) for k, t, i in spy.done if k != "base"} == {
        (t, i) for t in ("sorting", "capitals") for i in range(3)}
    assert all(summary["scores"][k][t]["n"] == 3
               for k in ("sorting", "capitals", "global") for t in ("sorting", "capitals"))
