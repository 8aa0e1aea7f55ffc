"""FedOA (paper 001): a private adapter regularised toward the global one's features.

Like FedDPA-T (every round, round 0 included, as Algorithm 1: local step, then global step; only the
global uploaded; ``local_from=1`` is the reference code's reading, the local adapter from round 1),
but the local adapter runs alone, with ``loss = CE_local + lambda * D(E_local, E_global)`` where E is
the final-layer state of the last token (global features detached, docs/methods.md 3.1); D is the
reference's Frobenius norm over the batch (``l2``, the paper) or ``cosine`` / ``pearson``; lambda 0.5.
The batch is the optimizer step's whole logical batch (:class:`FedOALoss`), so D's strength does not
change with ``--micro-batch-size``. The unsquared norm grows with the square root of the rows it covers,
so a preset's smaller batch would weaken lambda (to 0.5x at batch 8): ``l2`` is scaled by
``sqrt(norm_batch / rows)`` with ``norm_batch`` = 32, the paper's batch, so at the paper's batch it is the
reference's value exactly and at any other batch it keeps the paper's weight; ``norm_batch=0`` turns
the scaling off (the reference's value at every batch size).
At inference the client uses its local adapter (intra-client), so the mixture weight is 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training.algorithms.fedit import FEDAVG_OPTIONS, FedAvgStrategy, train_global
from training.algorithms.local import fresh_local
from training.algorithms.terms.batch_terms import SplitTerm, eval_mode, micro_share, split_term
from training.algorithms.terms.features import feature_distance, last_token
from training.local.lm_forward import lm_forward
from training.local.packing import padded_states
from training.local.regime import Regime
from training.local.runtime import Runtime
from training.local.train import train_adapters
from training.options import Option
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method
from training.state import derive_seed

# Paper 001 section 5 and App. C: K = 2 local epochs, batch 32, T = 20; lr, AdamW and the linear decay are the
# reference code's (same FedDPA skeleton, docs/methods.md 3).
REGIME = Regime(local_epochs=2, source="paper 001 s5.1 + App. C (K=2 epochs, batch 32, T=20); lr/AdamW: reference code")


def _features(rt: Runtime, batch: dict[str, torch.Tensor], adapter: str | None,
              labels: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(LM loss or None, last-token final-layer features (B, H)); ``adapter`` None keeps the caller's context."""
    if adapter is None:
        out = lm_forward(rt.model, batch, with_loss=labels)
    else:
        with rt.adapted.context.uniform((adapter,), (1.0,), trainable=()):
            out = lm_forward(rt.model, batch, with_loss=labels)
    return out.loss, last_token(*padded_states(out.hidden, batch))


class FedOALoss:
    """The FedOA objective ``CE + lambda * D(E_local, E_global)`` with D over the whole logical batch.

    The reference computes D (an unsquared Frobenius norm for ``l2``) on each forward's batch; here the
    batch is the optimizer step's, whatever ``--micro-batch-size`` is (:mod:`training.algorithms.terms.batch_terms`).
    A :class:`training.local.train.BatchLoss`; the local adapter is on in the caller's context.
    """

    length_grouped = True  # its LM loss reads the rows' weights; D is the whole step's

    def __init__(self, lam: float, distance: str, norm_batch: int = 0) -> None:
        self.lam, self.distance, self.norm_batch = lam, distance, norm_batch
        self._split: SplitTerm | None = None
        self._index = 0

    def _term(self, local: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
        d = feature_distance(local, glob.detach(), self.distance)
        if self.distance == "l2" and self.norm_batch:  # the Frobenius norm grows like sqrt(rows)
            d = d * (self.norm_batch / local.shape[0]) ** 0.5
        return self.lam * d

    def begin_step(self, rt: Runtime, batches: Sequence[dict[str, torch.Tensor]], names: Sequence[str],
                   weights: torch.Tensor) -> None:
        self._split, self._index = None, 0
        if len(batches) < 2 or self.lam == 0:
            return  # one forward holds the whole batch: computed directly (and exactly, dropout included)
        feats, consts = [], []
        row = weights.reshape(-1).tolist()  # every row's weights, read once a step (the layers read host floats)
        with eval_mode(rt.model):
            for b in batches:
                with rt.adapted.context.uniform(tuple(names), row, trainable=()):
                    feats.append((_features(rt, b, None)[1],))
                consts.append((_features(rt, b, "global")[1],))
        self._split = split_term(self._term, feats, consts)

    def __call__(self, rt: Runtime, batch: dict[str, torch.Tensor], names, weights):
        loss, e_local = _features(rt, batch, None, labels=True)
        assert loss is not None
        if self._split is not None:
            reg = micro_share(self._split, self._index, (e_local,))
            self._index += 1
            return loss + reg, {"reg": float(self._split.value)}
        with torch.no_grad():
            e_global = _features(rt, batch, "global")[1]
        reg = self._term(e_local, e_global)
        return loss + reg, {"reg": float(reg.detach())}


def fedoa_loss(lam: float, distance: str, norm_batch: int = 0) -> FedOALoss:
    """The FedOA objective as a :data:`training.local.train.LossFn` (local adapter on in the context)."""
    return FedOALoss(lam, distance, norm_batch)


class FedOAClient(ClientAlgorithm):
    """Client of FedOA: regularised local step (local alone), then the global step."""

    def __init__(self, lam: float = 0.5, distance: str = "l2", local_from: int = 0, norm_batch: int = 32) -> None:
        if lam < 0 or distance not in ("l2", "cosine", "pearson") or local_from not in (0, 1) or norm_batch < 0:
            raise ValueError(f"FedOA needs lambda >= 0, distance in l2/cosine/pearson, local_from 0 or 1 and "
                             f"norm_batch >= 0, got {lam}, {distance!r}, {local_from}, {norm_batch}")
        self.lam, self.distance, self.local_from, self.norm_batch = lam, distance, local_from, norm_batch

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        metrics: dict[str, float] = {}
        rt = ctx.runtime
        if ins.round >= self.local_from:
            rt.set("global", ins.state)
            rt.set("local", ctx.private.get("local") or fresh_local(ctx))
            res = train_adapters(rt, rt.examples(ctx.data), ["local"], ["local"], [1.0],
                                 seed=derive_seed(ctx.seed, ins.round, ctx.client_id, "local"),
                                 loss_fn=fedoa_loss(self.lam, self.distance, self.norm_batch),
                                 desc=f"r{ins.round} {ctx.client_id} local", round_idx=ins.round)
            ctx.private["local"] = rt.get("local")
            metrics.update({f"local_{k}": v for k, v in res.metrics().items()})
        state, global_metrics = train_global(ins, ctx)
        metrics.update(global_metrics)
        return FitRes(ctx.client_id, state, len(ctx.data.train), metrics)


FEDOA = Method(
    name="fedoa", strategy=FedAvgStrategy.from_options,
    client=lambda o: FedOAClient(lam=float(o.get("lambda", 0.5)), distance=str(o.get("distance", "l2")),
                                 local_from=int(o.get("local_from", 0)), norm_batch=int(o.get("norm_batch", 32))),
    has_local=True, inference_weight=1.0,
    options=(
        Option("lambda", float, 0.5, "weight of the orthogonality term between the adapters' features", low=0),
        Option("distance", str, "l2", "the feature distance", choices=("l2", "cosine", "pearson")),
        Option("local_from", int, 0, "first round that trains the local adapter", choices=(0, 1)),
        Option("norm_batch", int, 32, "rows the l2 distance is normalised to (0: no normalisation)", low=0),
        *FEDAVG_OPTIONS),
    regime=REGIME,
)
