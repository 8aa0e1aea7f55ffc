"""End-to-end ``fedmosaic eval`` on a run directory built here (tiny model, random adapters)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from adapters import LoraConfig, inject, save_adapter
from adapters.rundir import RunDir
from fedmosaic.cli import main
from fedmosaic.evaluate import EvalOptions, evaluate_run
from fedmosaic.tiny import save_tiny_llama, tiny_llama

DATA = {"n_train": 4, "n_test": 3, "families": ["sorting", "capitals"]}


def build_run(root: Path) -> RunDir:
    model_dir = save_tiny_llama(root / "model")
    run = RunDir(root / "run")
    run.root.mkdir(parents=True)
    run.run_json.write_text(json.dumps({"method": "FedDPA-T", "data": "generated", "data_options": DATA,
                                        "model": str(model_dir), "inference_weight": 0.5}))
    adapted = inject(tiny_llama().model)
    gen = torch.Generator().manual_seed(0)
    for name, folder in (("g", run.global_adapter), ("l0", run.local_adapter("sorting")),
                         ("l1", run.local_adapter("capitals")), ("r1", run.round_dir(1) / "global")):
        adapted.add_adapter(name, LoraConfig(r=4), seed=len(name))
        for _, layer in adapted.adapter_layers(name):
            with torch.no_grad():
                layer.adapters[name].lora_B.copy_(torch.randn(layer.adapters[name].lora_B.shape, generator=gen))
        save_adapter(adapted, name, folder)
    return run


def test_evaluate_run_writes_tables_json_and_plots(tmp_path: Path) -> None:
    run = build_run(tmp_path)
    opts = EvalOptions(limit=2, max_new_tokens=3, batch_size=2, per_round=True, dtype="float32")
    summary = evaluate_run(run.root, opts)
    assert summary["clients"] == ["sorting", "capitals"]
    assert set(summary["scores"]) == {"sorting", "capitals", "global", "base"}
    assert summary["scores"]["base"]["sorting"]["n"] == 2
    md = (run.eval_dir / "table.md").read_text()
    assert "Personalization" in md and "| FedDPA-T |" in md and "| FedDPA-T [base] |" in md
    saved = json.loads((run.eval_dir / "results.json").read_text())
    assert saved["tables"]["personalization"][0]["label"] == "FedDPA-T" and "1" in saved["per_round"]
    for png in ("scores.png", "rounds.png"):
        assert (run.eval_dir / png).read_bytes()[:4] == b"\x89PNG"
    lines = (run.eval_dir / "predictions" / "final" / "sorting" / "capitals.jsonl").read_text().splitlines()
    assert len(lines) == 2 and {"prompt", "prediction", "reference"} <= set(json.loads(lines[0]))

    calls = []

    def counting(prompts, names, weights):  # noqa: ANN001, ANN202
        calls.append(len(prompts))
        return ["x"] * len(prompts)

    evaluate_run(run.root, opts, generate_fn=counting)  # everything cached: nothing regenerated
    assert calls == []
    assert main(["eval", str(run.root), str(run.root), "--compare", "--out", str(tmp_path / "cmp.md")]) == 0
    assert (tmp_path / "cmp.md").read_text().count("| FedDPA-T |") == 4  # two runs x two blocks
