"""Flower under faults, on Flower's simulation runtime with real processes: a node's malformed and NaN
replies cost its client those rounds only, and a server side SIGKILLed mid-round resumes (resume=true) to
the adapters of an uninterrupted run, the nodes' private state included.

The killed attempt is a subprocess running the ServerApp and two virtual SuperNodes (Ray). In round 2
(of 3) the ``capitals`` node stalls until ``sorting``'s node has stored its round-2 private state, and the
test kills the whole process tree there: round 1 is the last complete round while ``sorting``'s node
already holds a newer local adapter, and ``capitals``' node holds a round-1 adapter whose reply was
rejected. The resumed run must start both from the versions the checkpoint names. The reference is the
in-process simulator with ``capitals`` failing rounds 0 and 1 (Flower and the simulator agree to 1e-6:
tests/training/flower/test_flower.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from models import tiny_llama
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.flower.app import FlowerConfig, run_flower_simulation
from training.local.runtime import preset
from training.simulation import SimConfig, run_federated

REPO = Path(__file__).resolve().parents[3]
DATA_OPTIONS = {"n_train": 4, "n_test": 2, "families": ["sorting", "capitals"]}

# The killed attempt: FedDPA-T's ClientApp, except for capitals: a malformed reply in round 0, NaN in round 1,
# a stall in round 2 (until sorting's round-2 state is on its node's disk).
CRASHING_RUN = r'''
import json, sys, time
from pathlib import Path
import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.simulation import run_simulation
from training.flower.app import FlowerConfig, client_resources, make_client_app, make_server_app
from training.flower.messages import read_fit_content

cfg = FlowerConfig(**json.loads(sys.argv[1]))
inner, app, stalled = make_client_app(cfg), ClientApp(), Path(sys.argv[2])

@app.query("identify")
def identify(msg, context):
    return inner(msg, context)

@app.train()
def train(msg, context):
    cid, ins = read_fit_content(msg.content)
    if cid == "capitals" and ins.round == 2:
        deadline = time.monotonic() + 300
        while not (Path(cfg.out) / "flower-clients" / "sorting" / "v2").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        stalled.write_text("stalled")
        time.sleep(600)
    out = inner(msg, context)
    if cid == "capitals" and ins.round == 0:  # no metrics record: not our wire format
        return Message(content=RecordDict({"arrays": out.content["arrays"], "config": out.content["config"]}),
                       reply_to=msg)
    if cid == "capitals" and ins.round == 1:
        arrays = {k: torch.full_like(v, float("nan")) for k, v in out.content["arrays"].to_torch_state_dict().items()}
        out.content["arrays"] = ArrayRecord(torch_state_dict=arrays)
    return out

run_simulation(server_app=make_server_app(cfg), client_app=app, num_supernodes=2,
               backend_config={"client_resources": client_resources(cfg, 2)})
'''


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process this test started and every process it started (Ray's), by id."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)


def _adapters(run: RunDir) -> dict[str, torch.Tensor]:
    out = {f"global/{k}": v for k, v in load_file(str(run.global_adapter / "adapter_model.safetensors")).items()}
    for c in DATA_OPTIONS["families"]:
        local = load_file(str(run.local_adapter(c) / "adapter_model.safetensors"))
        out.update({f"{c}/{k}": v for k, v in local.items()})
    return out


def test_bad_replies_and_a_killed_server_resume_to_the_uninterrupted_run(tmp_path: Path) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    cfg = FlowerConfig(method="feddpa-t", data="generated", rounds=3, out=str(tmp_path / "flower"), model="tiny",
                       preset="tiny", data_options=DATA_OPTIONS, timeout=120)
    stalled = tmp_path / "stalled"
    fields = {k: v for k, v in cfg.__dict__.items()}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_RUN, json.dumps(fields), str(stalled)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "crash.log", "wb"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 400
        while not stalled.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert stalled.exists(), (tmp_path / "crash.log").read_text()[-3000:]
    finally:
        _kill_tree(proc)
    run = RunDir(Path(cfg.out))
    mirror = Path(cfg.out) / "flower-clients"
    assert run.rounds() == [0, 1] and not (run.root / "summary.json").exists()
    assert (mirror / "sorting" / "v2").is_dir() and (mirror / "capitals" / "v1").is_dir()  # newer than committed
    rows = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    failed = {x["round"]: (x["status"], x["error"]) for x in rows if x.get("client") == "capitals"}
    assert failed[0][0] == "failed" and "malformed reply" in failed[0][1]
    assert failed[1][0] == "rejected" and "NaN" in failed[1][1]

    resumed = run_flower_simulation(FlowerConfig(**{**fields, "resume": True}), num_clients=2)
    reference = run_federated("feddpa-t", generate_suite(**DATA_OPTIONS), tiny_llama(), tmp_path / "local",  # type: ignore[arg-type]
                              SimConfig(RoundConfig(rounds=3), failures=frozenset({(0, "capitals"), (1, "capitals")})),
                              preset("tiny"), data_spec="generated", data_options=DATA_OPTIONS)
    a, b = _adapters(resumed), _adapters(RunDir(Path(reference.run_dir)))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    rows = [json.loads(x) for x in resumed.metrics.read_text().splitlines()]
    assert [x["clients"] for x in rows if x.get("aggregate")] == [1, 1, 2]  # round 2 once, both clients back
    assert (resumed.root / "summary.json").is_file()


def test_the_run_config_in_pyproject_names_only_flower_config_fields() -> None:
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert {"resume", "timeout"} <= set(declared)  # flwr refuses --run-config keys the app does not declare
    assert all(k.replace("-", "_") in FlowerConfig.__dataclass_fields__ for k in declared)
    loaded = FlowerConfig.from_run_config({**declared, "resume": True})
    assert loaded.resume is True and loaded.timeout == 3600.0
