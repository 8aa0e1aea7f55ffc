"""FedDPA-F and FedDPA-T: a shared global adapter plus a private local adapter (paper 000, section 4).

FedDPA-T as implemented here (paper Algorithm 2, docs/methods.md 2.2): in every round, round 0 included,
each selected client first trains its local adapter beside the frozen received global with the forward
``W0 x + (1 - alpha) dW_global x (detached) + alpha dW_local x``; the local adapter starts fresh (B = 0)
at the client's first round and is its private state afterwards. The client then trains the global
adapter alone from the received global and uploads only that; the server averages with equal weights.
(Both phases start from the received global, so their order does not matter.) ``local_from=1`` is the
reference code's reading: round 0 trains only the global (FedIT) and the local adapter starts at
round 1. alpha = 0.5 on dataset 1 and 0.3 on dataset 2 (paper 000 s5.1: ``--data feddpa2`` sets it, as does
a folder holding dataset 2's files, :func:`training.data.data_key`);
at inference lambda = alpha.

``mu > 0`` runs either variant inside FedProx (paper 000 Table 8: FedDPA's local adapters on top of a
FedProx global): the global step adds ``mu/2 ||theta - theta_g||^2`` toward the received global.

FedDPA-F (section 4.2): FedIT, then the local adapter is a copy of the final global fine-tuned on the
client's data (the author's recipe, docs/methods.md 2.7); inference lambda = 1.
"""

from __future__ import annotations

from training.algorithms.fedit import FEDAVG_OPTIONS, FedAvgClient, FedAvgStrategy, mu_option, train_global
from training.algorithms.local import FineTuneClient, fresh_local, train_local
from training.local.regime import FEDDPA_REGIME
from training.options import Option
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method


class FedDPATClient(ClientAlgorithm):
    """Client of FedDPA-T: local step beside the frozen global, then the global step; uploads the global."""

    def __init__(self, alpha: float = 0.5, mu: float = 0.0, local_from: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0 or local_from not in (0, 1):
            raise ValueError(f"FedDPA-T needs alpha in [0, 1] and local_from 0 or 1, got {alpha}, {local_from}")
        self.alpha, self.local_from = alpha, local_from
        self.prox = FedAvgClient(mu)  # mu = 0: FedIT's global step; mu > 0: FedProx's (Table 8)

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        metrics: dict[str, float] = {}
        if ins.round >= self.local_from:
            ctx.runtime.set("global", ins.state)
            start = ctx.private.get("local") or fresh_local(ctx)
            metrics.update(train_local(ctx, ins.round, start, names=("global", "local"),
                                       weights=(1.0 - self.alpha, self.alpha)))
        state, global_metrics = train_global(ins, ctx, self.prox.loss(ins.state))
        metrics.update(global_metrics)
        return FitRes(ctx.client_id, state, len(ctx.data.train), metrics)


FEDDPA_T = Method(
    name="feddpa-t", strategy=FedAvgStrategy.from_options, regime=FEDDPA_REGIME,
    client=lambda o: FedDPATClient(alpha=float(o.get("alpha", 0.5)), mu=float(o.get("mu", 0.0)),
                                   local_from=int(o.get("local_from", 0))),
    has_local=True, instance_weighting=True,
    inference_weight=0.5, options=(
        Option("alpha", float, 0.5, "the local adapter's weight in training and at inference (lambda)", low=0, high=1),
        mu_option(0.0),
        Option("local_from", int, 0, "first round that trains the local adapter (1: the reference code)",
               choices=(0, 1)),
        *FEDAVG_OPTIONS),
    inference_option="alpha", data_defaults={"feddpa2": {"alpha": 0.3}},
)
FEDDPA_F = Method(
    name="feddpa-f", strategy=FedAvgStrategy.from_options, regime=FEDDPA_REGIME,
    client=lambda o: FineTuneClient(mu=float(o.get("mu", 0.0))), has_local=True, instance_weighting=True,
    inference_weight=1.0, inference_option="lambda",
    options=(Option("lambda", float, 1.0, "the local adapter's weight at inference", low=0, high=1), mu_option(0.0),
             *FEDAVG_OPTIONS),
)
