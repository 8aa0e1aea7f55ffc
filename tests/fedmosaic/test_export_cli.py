"""``fedmosaic export``: a client's adapter as one PEFT folder that PEFT loads with the served logits, for a
FedDPA run whose global and local adapters differ in targets and rank; and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from adapters import save_adapter
from adapters.amole_io import CONFIG
from fedmosaic.cli import main
from models import tiny_llama
from serving.stack import StackConfig, build_stack
from tests.adapters.mixed import mixed_adapters

IDS = torch.tensor([[5, 17, 33, 8, 90, 4, 7], [9, 10, 11, 12, 13, 14, 15]])


def feddpa_run(root: Path, weight: float | None = 0.3) -> Path:
    """A FedDPA-shaped run: an all-linear rank-2 global and a q/v rank-4 local adapter for client c0."""
    adapted = mixed_adapters(tiny_llama().model, ("all", "qv"))
    save_adapter(adapted, "all", root / "adapters" / "global")
    save_adapter(adapted, "qv", root / "adapters" / "clients" / "c0" / "local")
    meta = {"method": "feddpa-t", "model": "tiny", **({"inference_weight": weight} if weight is not None else {})}
    (root / "run.json").write_text(json.dumps(meta))
    return root


def test_a_feddpa_client_exports_to_peft_with_the_served_logits(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = feddpa_run(tmp_path / "run")
    assert main(["export", str(run), "--client", "c0", "--out", str(tmp_path / "c0")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rank"] == 2 + 4 and summary["modules"] == 14 and summary["weights"] == {"global": 0.7, "local": 0.3}
    stack = build_stack(StackConfig(model="tiny", dtype="float32", device="cpu", run_dir=run))
    names = stack.pool.acquire(["global", "c0:local"]).names
    with torch.no_grad(), stack.adapted.context.uniform(names, (0.7, 0.3)):
        served = stack.loaded.model(IDS).logits
    peft = PeftModel.from_pretrained(tiny_llama().model, str(tmp_path / "c0")).eval()
    with torch.no_grad():
        assert (peft(IDS).logits - served).abs().max().item() < 1e-5
    assert main(["export", str(run), "--client", "c0", "--out", str(tmp_path / "a1"), "--weight", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["rank"] == 4  # the global at weight 0 is left out


def test_export_refusals(tmp_path: Path) -> None:
    run = feddpa_run(tmp_path / "run", weight=None)
    for args, reason in ((["--client", "c0"], "records no inference_weight: give --weight"),
                         (["--client", "c0", "--weight", "1.5"], r"--weight must be in \[0, 1\]"),
                         (["--client", "nobody", "--weight", "0.5"], "has no client 'nobody'"),
                         (["--client", "../x", "--weight", "0.5"], "client")):
        with pytest.raises(SystemExit, match=reason):
            main(["export", str(run), *args, "--out", str(tmp_path / "out")])
    (run / "adapters" / "amole").mkdir()
    (run / "adapters" / "amole" / CONFIG).write_text("{}")
    with pytest.raises(SystemExit, match="FedAMoLE run"):
        main(["export", str(run), "--client", "c0", "--weight", "0.5", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
