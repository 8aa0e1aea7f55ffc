"""FedMCP (paper 004): global + private adapters with averaged outputs and a CKA contrast term.

Per batch (paper 004 section 3; docs/methods.md 5, LoRA adapters and the LM head instead of bottleneck
adapters and classifiers, our decision):
    L_a: LM loss of the full model, both adapters at weight 1/2
    L_b: LM loss with the client's global adapter alone (X = its mean-pooled final states)
    L_c: CKA(X, Y) - CKA(X, Z), Y = states with the private adapter alone (Eq. 5, s IV-D; docs/design.md's
         CKA(g, p)), Z = states with the received averaged global (frozen)
    L = (1 - gamma) L_a + gamma L_b + mu L_c,   gamma 0.5, mu 0.05
Both adapters train; only the global is uploaded and averaged uniformly; the private one stays local.
``contrast_y=full`` is the cheaper reading of docs/methods.md 5 (Y = the full two-adapter model's states, no
extra forward). L_c is computed over the optimizer step's whole batch (64 in the paper), whatever
``--micro-batch-size`` is: CKA does not decompose over micro-batches (:class:`FedMCPLoss`). CKA is the
debiased estimator by default (``cka=unbiased``, :func:`training.algorithms.terms.cka.unbiased_linear_cka`):
the plain one scores about 0.99 for two unrelated batches of 8 rows of SmolLM2 width, so its value would change with
the batch a preset imposes; ``cka=biased`` is the paper's formula. ``similarity=cosine`` is the paper's
ablation (section 4.4: cosine similarity instead of CKA, -1.45 %): mean row-wise cosine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training.algorithms.fedit import FedAvgStrategy
from training.algorithms.local import fresh_local
from training.algorithms.terms.batch_terms import SplitTerm, eval_mode, micro_share, split_term
from training.algorithms.terms.cka import linear_cka, unbiased_linear_cka
from training.algorithms.terms.features import mean_pool
from training.federation.robust import OPTIONS as ROBUST_OPTIONS
from training.local.lm_forward import lm_forward
from training.local.packing import padded_states
from training.local.regime import Regime
from training.local.runtime import Runtime
from training.local.train import train_adapters
from training.options import Option
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method
from training.state import derive_seed

# Paper 004 section 4.1: Adam, lr 5e-4, batch 64, one local epoch per round, 25 rounds (no schedule named).
REGIME = Regime(optimizer="adam", lr=5e-4, schedule="constant", batch_size=64, local_epochs=1, rounds=25,
                source="paper 004 s4.1 (Adam 5e-4, batch 64, 1 epoch, 25 rounds)")


def similarity(a: torch.Tensor, b: torch.Tensor, kind: str = "cka", unbiased: bool = False) -> torch.Tensor:
    """FedMCP's representation similarity: linear CKA (paper; ``unbiased``: debiased) or the mean cosine."""
    if kind == "cka":
        return unbiased_linear_cka(a, b) if unbiased else linear_cka(a, b)
    if kind == "cosine":
        return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean()
    raise ValueError(f"FedMCP similarity must be cka or cosine, got {kind!r}")


def _pooled(rt: Runtime, batch: dict[str, torch.Tensor], adapter: str | None, labels: bool = False,
            trainable: tuple[str, ...] = ()) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(LM loss or None, mean-pooled final-layer states (B, H)); ``adapter`` None keeps the caller's context."""
    if adapter is None:
        out = lm_forward(rt.model, batch, with_loss=labels)
    else:
        with rt.adapted.context.uniform((adapter,), (1.0,), trainable=trainable):
            out = lm_forward(rt.model, batch, with_loss=labels)
    return out.loss, mean_pool(*padded_states(out.hidden, batch))


class FedMCPLoss:
    """FedMCP's objective, its contrast term over the whole logical batch
    (:mod:`training.algorithms.terms.batch_terms`).

    Linear CKA does not decompose over micro-batches, so the term is the optimizer step's whatever
    ``--micro-batch-size`` is. A :class:`training.local.train.BatchLoss`; the caller's context has
    (global, local) on at (1/2, 1/2), both trainable. ``private_y``: Y is the private adapter alone (the
    paper); False: the full model's states. ``unbiased``: the debiased CKA.
    """

    length_grouped = True  # its LM losses read the rows' weights; L_c is the whole step's

    def __init__(self, gamma: float, mu: float, kind: str = "cka", private_y: bool = True,
                 unbiased: bool = True) -> None:
        self.gamma, self.mu, self.kind, self.private_y, self.unbiased = gamma, mu, kind, private_y, unbiased
        self.min_rows = 4 if unbiased and kind == "cka" else 2  # a centred sample (n - 3 for the unbiased one)
        self._split: SplitTerm | None = None
        self._index = 0

    def _term(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:
            return x.sum() * 0.0
        return self.mu * (similarity(x, y, self.kind, self.unbiased)
                          - similarity(x, z.detach(), self.kind, self.unbiased))

    def _y(self, rt: Runtime, batch: dict[str, torch.Tensor], full: torch.Tensor, trainable: tuple[str, ...]):
        """Y: the private adapter's pooled states (``full``'s when ``private_y`` is off)."""
        return _pooled(rt, batch, "local", trainable=trainable)[1] if self.private_y else full

    def begin_step(self, rt: Runtime, batches: Sequence[dict[str, torch.Tensor]], names: Sequence[str],
                   weights: torch.Tensor) -> None:
        self._split, self._index = None, 0
        if len(batches) < 2 or self.mu == 0:
            return  # one forward holds the whole batch: computed directly
        feats, consts = [], []
        row = weights.reshape(-1).tolist()  # every row's weights, read once a step (the layers read host floats)
        with eval_mode(rt.model):
            for b in batches:
                with rt.adapted.context.uniform(tuple(names), row, trainable=()):
                    full = _pooled(rt, b, None)[1] if not self.private_y else torch.empty(0)
                feats.append((_pooled(rt, b, "global")[1], self._y(rt, b, full, ())))
                consts.append((_pooled(rt, b, "received")[1],))
        self._split = split_term(self._term, feats, consts)

    def __call__(self, rt: Runtime, batch: dict[str, torch.Tensor], names, weights):
        full_loss, full = _pooled(rt, batch, None, labels=True)
        glob_loss, x = _pooled(rt, batch, "global", labels=True, trainable=("global",))
        assert full_loss is not None and glob_loss is not None
        loss = (1 - self.gamma) * full_loss + self.gamma * glob_loss
        if self.mu == 0 or (self._split is None and x.shape[0] < self.min_rows):
            return loss, {}
        y = self._y(rt, batch, full, ("local",))
        if self._split is not None:
            share = micro_share(self._split, self._index, (x, y))
            self._index += 1
            return loss + share, {"cka_contrast": float(self._split.value) / self.mu}
        with torch.no_grad():
            z = _pooled(rt, batch, "received")[1]
        term = self._term(x, y, z)
        return loss + term, {"cka_contrast": float(term.detach()) / self.mu}


def fedmcp_loss(gamma: float, mu: float, kind: str = "cka", private_y: bool = True,
                unbiased: bool = True) -> FedMCPLoss:
    """FedMCP's objective; the caller's context has (global, local) on at (1/2, 1/2), both trainable."""
    return FedMCPLoss(gamma, mu, kind, private_y, unbiased)


class FedMCPClient(ClientAlgorithm):
    """Client of FedMCP: both adapters trained together; uploads the global one."""

    def __init__(self, gamma: float = 0.5, mu: float = 0.05, similarity: str = "cka", contrast_y: str = "private",
                 cka: str = "unbiased") -> None:
        if (not 0 <= gamma <= 1 or mu < 0 or similarity not in ("cka", "cosine")
                or contrast_y not in ("private", "full") or cka not in ("unbiased", "biased")):
            raise ValueError(f"FedMCP needs gamma in [0, 1], mu >= 0, similarity cka or cosine, contrast_y private "
                             f"or full and cka unbiased or biased, got {gamma}, {mu}, {similarity!r}, {contrast_y!r}, "
                             f"{cka!r}")
        self.gamma, self.mu, self.similarity = gamma, mu, similarity
        self.private_y, self.unbiased = contrast_y == "private", cka == "unbiased"

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        rt = ctx.runtime
        rt.set("global", ins.state)
        rt.set("received", ins.state)
        rt.set("local", ctx.private.get("local") or fresh_local(ctx))
        res = train_adapters(rt, rt.examples(ctx.data), ["global", "local"], ["global", "local"], [0.5, 0.5],
                             seed=derive_seed(ctx.seed, ins.round, ctx.client_id, "mcp"),
                             loss_fn=fedmcp_loss(self.gamma, self.mu, self.similarity, self.private_y, self.unbiased),
                             desc=f"r{ins.round} {ctx.client_id} mcp", round_idx=ins.round)
        ctx.private["local"] = rt.get("local")
        return FitRes(ctx.client_id, rt.get("global"), len(ctx.data.train), res.metrics())


FEDMCP = Method(
    name="fedmcp", strategy=lambda o: FedAvgStrategy.from_options(o, weighting="equal"),  # the paper: uniformly
    client=lambda o: FedMCPClient(gamma=float(o.get("gamma", 0.5)), mu=float(o.get("mu", 0.05)),
                                  similarity=str(o.get("similarity", "cka")),
                                  contrast_y=str(o.get("contrast_y", "private")), cka=str(o.get("cka", "unbiased"))),
    has_local=True, inference_weight=0.5,
    options=(  # no weighting: the paper averages uniformly (fixed in the strategy above)
        Option("gamma", float, 0.5, "weight of the global-alone LM loss L_b (L_a gets 1 - gamma)", low=0, high=1),
        Option("mu", float, 0.05, "weight of the CKA contrast term L_c", low=0),
        Option("similarity", str, "cka", "the representation similarity", choices=("cka", "cosine")),
        Option("contrast_y", str, "private", "Y of the contrast: the private adapter's states or the full model's",
               choices=("private", "full")),
        Option("cka", str, "unbiased", "the CKA estimator (biased: the paper's formula)",
               choices=("unbiased", "biased")),
        *ROBUST_OPTIONS),
    regime=REGIME,
)
