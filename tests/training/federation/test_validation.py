"""Reply validation before aggregation: every bad-reply kind is named, and in a real run a bad reply costs
its client that round only (the run ends exactly as if the client had failed those rounds)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from models import tiny_llama
from training.algorithms.feddpa import FEDDPA_T
from training.algorithms.fedit import FedAvgStrategy
from training.algorithms.pfedseq.method import RECEIVED, PFedSeqConfig, PFedSeqStrategy, checksum
from training.data import generate_suite
from training.federation.rounds import RoundConfig, RunPlan, run_record, run_rounds
from training.federation.validation import reply_problem
from training.local.runtime import Runtime, preset
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method
from training.simulation import InProcessTransport, SimConfig, run_federated

SENT = {"m.lora_A": torch.zeros(2, 3), "m.lora_B": torch.zeros(3, 2)}
GOOD = FitRes("a", {"m.lora_A": torch.ones(2, 3), "m.lora_B": torch.ones(3, 2)}, 4, {"loss": 1.5})


def _with_state(res: FitRes, **state: torch.Tensor) -> FitRes:
    return dataclasses.replace(res, state={**res.state, **state})


def _poke(res: FitRes, value: float) -> FitRes:
    key = next(iter(res.state))
    t = res.state[key].clone()
    t.view(-1)[0] = value
    return _with_state(res, **{key: t})


def _drop(res: FitRes) -> FitRes:
    first = next(iter(res.state))
    return dataclasses.replace(res, state={k: v for k, v in res.state.items() if k != first})


def _reshape(res: FitRes) -> FitRes:
    key = next(iter(res.state))
    return _with_state(res, **{key: torch.zeros(res.state[key].shape[0] + 1, *res.state[key].shape[1:])})


# kind -> (corruption of an honest reply, what the reason says)
BAD: dict[str, tuple[Callable[[FitRes], FitRes], str]] = {
    "extra_key": (lambda r: _with_state(r, **{"smuggled.lora_A": torch.zeros(1)}), "unexpected tensor"),
    "missing_key": (_drop, "lacks 1 tensor"),
    "wrong_shape": (_reshape, "has shape"),
    "wrong_dtype": (lambda r: _with_state(r, **{k: v.double() for k, v in r.state.items()}), "has dtype"),
    "not_a_tensor": (lambda r: _with_state(r, **{next(iter(r.state)): [0.0]}), "not a tensor"),  # type: ignore[dict-item]
    "nan": (lambda r: _poke(r, float("nan")), "NaN or infinite"),
    "inf": (lambda r: _poke(r, float("inf")), "NaN or infinite"),
    "negative_examples": (lambda r: dataclasses.replace(r, num_examples=-3), "outside [1,"),
    "zero_examples": (lambda r: dataclasses.replace(r, num_examples=0), "outside [1,"),
    "absurd_examples": (lambda r: dataclasses.replace(r, num_examples=10**9), "outside [1,"),
    "float_examples": (lambda r: dataclasses.replace(r, num_examples=2.5), "not an int"),  # type: ignore[arg-type]
    "nan_metric": (lambda r: dataclasses.replace(r, metrics={"loss": math.nan}), "not a finite number"),
    "text_metric": (lambda r: dataclasses.replace(r, metrics={"loss": "low"}), "not a finite number"),
    "wrong_client": (lambda r: dataclasses.replace(r, client_id="b"), "names client 'b'"),
}


def test_an_honest_reply_passes() -> None:
    assert reply_problem(GOOD, FitIns(0, SENT), FedAvgStrategy(), "a", max_examples=4) is None


@pytest.mark.parametrize("kind", sorted(BAD))
def test_every_bad_reply_kind_is_named(kind: str) -> None:
    corrupt, reason = BAD[kind]
    problem = reply_problem(corrupt(GOOD), FitIns(0, SENT), FedAvgStrategy(), "a", max_examples=4)
    assert problem is not None and reason in problem


def test_pfedseq_refuses_an_update_from_another_adapter_as_a_reason_not_an_exception() -> None:
    strategy = PFedSeqStrategy(PFedSeqConfig(server_device="cpu"))
    ins = strategy.configure_round(0, ["a"], SENT)["a"]
    honest = dataclasses.replace(GOOD, metrics={RECEIVED: checksum(SENT)})
    assert reply_problem(honest, ins, strategy, "a", 4) is None
    other = dataclasses.replace(GOOD, metrics={RECEIVED: checksum(SENT) + 1.0})
    assert "trained from another adapter" in (reply_problem(other, ins, strategy, "a", 4) or "")


# --- a real run (FedDPA-T: a private local adapter too) with one client sending bad replies ---

FAMILIES = ["sorting", "capitals"]
DATA_OPTIONS = {"n_train": 4, "n_test": 1, "families": FAMILIES}
DATA = generate_suite(**DATA_OPTIONS)  # type: ignore[arg-type]
TRAIN = preset("tiny")
SPOILED = {1: "nan", 2: "extra_key"}  # round -> what capitals sends; round 0 and 3 are honest


class Spoiler(ClientAlgorithm):
    """FedDPA-T's client, except that ``capitals`` corrupts its reply in the rounds of :data:`SPOILED`."""

    def __init__(self, inner: ClientAlgorithm) -> None:
        self.inner = inner

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        res = self.inner.fit(ins, ctx)  # the private state moves on; the loop must roll it back
        if ctx.client_id == "capitals" and ins.round in SPOILED:
            return BAD[SPOILED[ins.round]][0](res)
        return res

    def finalize(self, state, ctx: ClientContext) -> dict[str, float]:  # noqa: ANN001
        return self.inner.finalize(state, ctx)


def _adapters(run: RunDir) -> dict[str, torch.Tensor]:
    out = {f"global/{k}": v for k, v in load_file(str(run.global_adapter / "adapter_model.safetensors")).items()}
    for c in FAMILIES:
        local = load_file(str(run.local_adapter(c) / "adapter_model.safetensors"))
        out.update({f"{c}/{k}": v for k, v in local.items()})
    return out


def test_bad_replies_leave_their_client_out_of_the_round_as_a_failure_would(tmp_path: Path) -> None:
    sim = SimConfig(RoundConfig(rounds=4), embed=False)
    method: Method = dataclasses.replace(FEDDPA_T, client=lambda o: Spoiler(FEDDPA_T.client(o)))
    opts = {**method.defaults, "seed": 0}
    rt = Runtime(tiny_llama(), TRAIN)
    run = RunDir(tmp_path / "spoiled")
    config = run_record(method, opts, sim.loop, TRAIN, data="generated", data_options=DATA_OPTIONS,
                        model="tiny", clients_per_task=1, device="cpu")
    summary = run_rounds(RunPlan(method, opts, DATA, rt, run, sim.loop, config),
                         InProcessTransport(method, method.client(opts), DATA, rt, sim))
    rows = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    rejected = {x["round"]: x["error"] for x in rows if x.get("status") == "rejected"}
    assert set(rejected) == set(SPOILED)
    assert all(x["client"] == "capitals" for x in rows if x.get("status") == "rejected")
    assert "NaN" in rejected[1] and "unexpected tensor" in rejected[2]
    assert [x["clients"] for x in rows if x.get("aggregate")] == [2, 1, 1, 2]
    assert [(r, c) for r, c, _ in summary.failures] == [(1, "capitals"), (2, "capitals")]
    # the reference: the same client simply failing those rounds (its private state kept as before)
    failed = run_federated("feddpa-t", DATA, tiny_llama(), tmp_path / "failed",
                           SimConfig(RoundConfig(rounds=4), embed=False,
                                     failures=frozenset((r, "capitals") for r in SPOILED)),
                           TRAIN, data_spec="generated", data_options=DATA_OPTIONS)
    a, b = _adapters(run), _adapters(RunDir(Path(failed.run_dir)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
