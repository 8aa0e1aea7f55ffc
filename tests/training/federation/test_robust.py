"""Robust aggregation: the maths against hand-computed numbers, off by default (bit-identical to FedAvg),
and a real run with one poisoned client, where the median and clipping keep the global adapter near the
clean run's while the plain mean is dragged away."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from models import tiny_llama
from training.algorithms.fedit import FEDIT, FedAvgStrategy
from training.data import generate_suite
from training.federation.aggregate import aggregate_results
from training.federation.robust import RobustConfig, clip_update, robust_aggregate
from training.federation.rounds import RoundConfig, RunPlan, run_record, run_rounds
from training.local.runtime import Runtime, preset
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method
from training.simulation import InProcessTransport, SimConfig

SENT = {"w": torch.zeros(3)}


def _res(cid: str, values: list[float], n: int = 1) -> FitRes:
    return FitRes(cid, {"w": torch.tensor(values)}, n)


UPLOADS = [_res("a", [1.0, 2.0, 3.0]), _res("b", [2.0, 0.0, 3.0]), _res("c", [3.0, 1.0, 3.0]),
           _res("d", [1000.0, -1000.0, 3.0])]  # d is poisoned


def test_median_and_trimmed_mean_against_hand_computed_values() -> None:
    med = robust_aggregate(UPLOADS, SENT, [1.0] * 4, RobustConfig(aggregator="median"))
    assert torch.equal(med["w"], torch.tensor([2.5, 0.5, 3.0]))  # even count: mean of the two middle values
    odd = robust_aggregate(UPLOADS[:3], SENT, [1.0] * 3, RobustConfig(aggregator="median"))
    assert torch.equal(odd["w"], torch.tensor([2.0, 1.0, 3.0]))
    trimmed = robust_aggregate(UPLOADS, SENT, [1.0] * 4, RobustConfig(aggregator="trimmed_mean", trim=0.25))
    assert torch.equal(trimmed["w"], torch.tensor([2.5, 0.5, 3.0]))  # one value dropped at each end
    mean = robust_aggregate(UPLOADS[:3], SENT, [1.0, 1.0, 2.0], RobustConfig(clip_norm=1e9))
    torch.testing.assert_close(mean["w"], torch.tensor([2.25, 1.0, 3.0]))  # weighted as the method weights


def test_clipping_bounds_each_update_norm() -> None:
    clipped = clip_update({"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}, 1.0)
    assert torch.allclose(clipped["a"].float(), torch.tensor([0.6, 0.0])) and torch.allclose(clipped["b"].float(),
                                                                                            torch.tensor([0.8]))
    small = clip_update({"a": torch.tensor([0.3])}, 1.0)
    assert torch.equal(small["a"].float(), torch.tensor([0.3]))
    out = robust_aggregate(UPLOADS, SENT, [1.0] * 4, RobustConfig(clip_norm=1.0))
    assert float(out["w"].norm()) <= 1.0 + 1e-6  # the mean of four updates of norm <= 1


def test_off_by_default_is_the_plain_average_bit_for_bit() -> None:
    strategy = FedAvgStrategy()
    assert not strategy.robust.active
    out = strategy.aggregate(0, UPLOADS, [], SENT)
    assert out is not None and torch.equal(out["w"], aggregate_results(UPLOADS)["w"])
    assert RobustConfig.from_options({"weighting": "equal"}) == RobustConfig()


@pytest.mark.parametrize(("options", "message"), [
    ({"aggregator": "mode"}, "aggregator must be"), ({"clip_norm": 0}, "clip_norm must be a positive"),
    ({"clip_norm": float("inf")}, "clip_norm must be a positive"), ({"trim": 0.5}, "trim must be in"),
])
def test_bad_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RobustConfig.from_options(options)


# --- a real FedIT run on the tiny model, three clients, one of them poisoned ---

FAMILIES = ["sorting", "capitals", "arithmetic"]
DATA_OPTIONS = {"n_train": 4, "n_test": 1, "families": FAMILIES}
DATA = generate_suite(**DATA_OPTIONS)  # type: ignore[arg-type]
TRAIN = preset("tiny")


class Poisoner(ClientAlgorithm):
    """FedIT's client, except that ``arithmetic`` scales its update by 1000 (finite: validation lets it in)."""

    def __init__(self, inner: ClientAlgorithm, poison: bool) -> None:
        self.inner, self.poison = inner, poison

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        res = self.inner.fit(ins, ctx)
        if not self.poison or ctx.client_id != "arithmetic":
            return res
        return dataclasses.replace(res, state={k: ins.state[k] + 1000.0 * (v - ins.state[k])
                                               for k, v in res.state.items()})


def _global(tmp: Path, name: str, poison: bool, **options: object) -> dict[str, torch.Tensor]:
    method: Method = dataclasses.replace(FEDIT, client=lambda o: Poisoner(FEDIT.client(o), poison))
    sim = SimConfig(RoundConfig(rounds=2), embed=False)
    opts = {**method.defaults, **options, "seed": 0}
    rt = Runtime(tiny_llama(), TRAIN)
    run = RunDir(tmp / name)
    config = run_record(method, opts, sim.loop, TRAIN, data="generated", data_options=DATA_OPTIONS,
                        model="tiny", clients_per_task=1, device="cpu")
    run_rounds(RunPlan(method, opts, DATA, rt, run, sim.loop, config),
               InProcessTransport(method, method.client(opts), DATA, rt, sim))
    return load_file(str(run.global_adapter / "adapter_model.safetensors"))


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum((a[k].double() - b[k].double()).pow(2).sum() for k in a) ** 0.5)


def test_a_poisoned_client_drags_the_mean_but_not_the_median_or_the_clipped_mean(tmp_path: Path) -> None:
    clean = _global(tmp_path, "clean", poison=False)
    plain = _global(tmp_path, "plain", poison=True)
    median = _global(tmp_path, "median", poison=True, aggregator="median")
    clipped = _global(tmp_path, "clipped", poison=True, clip_norm=0.05)
    clean_median = _global(tmp_path, "clean-median", poison=False, aggregator="median")
    drag = _distance(plain, clean)
    assert drag > 1.0  # the mean follows the poisoned update
    assert _distance(median, clean) < drag / 50 and _distance(clipped, clean) < drag / 50
    # the median of two honest clients and a poisoned one stays between honest values: near the clean median
    assert _distance(median, clean_median) < _distance(clean, clean_median) + drag / 50
