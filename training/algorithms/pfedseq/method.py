"""pFedSeq (paper 003, Algorithm 1; docs/methods.md 4.1): FedAvg global plus per-client calibrations from a
sequential learner over the last L rounds of client updates.

Client: trains the adapter it received (its personalized adapter theta_i^{t-1}) and uploads only the
update ``Delta_i^t = trained - received``. Its personalized model (its private ``local`` adapter, the one
``fedmosaic eval`` scores, inference weight 1) is Algorithm 1's output: after the last round the server's
aggregated global plus the client's last calibration, ``theta_i^T = global^T + xi_i^T`` (the global alone
when the run ends within the warm-up). ``personalize=trained`` keeps the client's own last trained
adapter ``theta_hat_i^T`` instead (the behaviour before this option).

Server, round t (1-based; our round index + 1): reconstruct ``theta_hat_i = theta_i^{t-1} + Delta_i``;
global = data-size-weighted FedAvg of the ``theta_hat_i`` (eq 1); if t >= 2, one Adam step of every
layer's learner on the previous window with the new updates as gradient proxy (eq 5); push the
updates into the history (last L rounds); for t <= W every client is sent the global, afterwards
``global + xi_i`` with ``xi = SeqLearner(last L steps)`` (eqs 3, 6). Clients missing from a round add a
zero update. Clients echo a checksum of what they received, so a runtime that does not deliver each
client's own FitIns fails loudly instead of corrupting the learner. The history, the sent
calibrations, the learners and Adam's moments are the strategy's checkpointed state (tensors, which the
checkpoint writes to ``strategy.safetensors``), so a resumed run repeats an uninterrupted one.

The learners see each layer's window divided by its RMS (:mod:`training.algorithms.pfedseq.history`); their
output is the last step of a residual stream that starts at the newest update, so at initialisation
``xi_i`` is close to client i's latest update (our reading of the paper's pre-norm residual Mamba
stack without a final norm; the paper states no output scale).

Options (paper defaults in ``PFEDSEQ.defaults``): ``warmup`` W (10), ``window`` L (10; 20 for the
paper's CIFAR runs; ``window=1`` is ablation B), ``learner`` ``ssm`` | ``lstm`` (ablation E) | ``mlp``
(ablation D), ``learner_lr`` (Adam, 1e-3), ``layers`` (2), ``d_state`` M (16), ``expand`` (2), ``d_conv``
(4), ``mlp_hidden`` (100), ``max_grad_norm`` (none; pFedHN clips at 50), ``chunk`` (coordinates per
learner pass, 2048), ``scan`` ``auto`` | ``torch`` | ``kernel`` (mamba-ssm), ``server_device`` ``auto`` (the
run's device: the base model's, i.e. ``--device`` / ``FEDMOSAIC_DEVICE``) | ``cpu`` | ``cuda[:i]``, ``clients``
(the roster, i.e. the learner's channels in order; default: the clients of the first round).
Ablations (paper section 5.3, Table 2): ``aggregation=false`` is variant A (no global aggregation: the
learner generates each client's adapter from its own, ``theta_i^t = theta_hat_i^t + xi_i^t``, our reading
of "generates personalized adapters directly"; the FedAvg global is still computed and exported);
``window=1`` is B; ``cross_client=false`` is C (each client's calibration from its own update sequence
only: one single-channel learner per layer, shared by the clients, run on each client's sequence alone).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models import settings
from training.algorithms.fedit import FedAvgStrategy, train_global
from training.algorithms.local import train_local
from training.algorithms.pfedseq.history import Layout, UpdateHistory, calibrate, learner_step
from training.algorithms.pfedseq.learners import KINDS, OwnSequence, make_learner
from training.federation.aggregate import weighted_average
from training.local.regime import Regime
from training.local.runtime import Runtime
from training.options import Option
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method
from training.state import StateDict, derive_seed


@dataclass(frozen=True)
class PFedSeqConfig:
    """Server settings of pFedSeq (see the module docstring for each option)."""

    warmup: int = 10
    window: int = 10
    learner: str = "ssm"
    learner_lr: float = 1e-3
    layers: int = 2
    d_state: int = 16
    expand: int = 2
    d_conv: int = 4
    mlp_hidden: int = 100
    max_grad_norm: float | None = None
    chunk: int = 2048
    scan: str = "auto"
    server_device: str = "auto"
    clients: tuple[str, ...] = ()
    aggregation: bool = True
    cross_client: bool = True
    personalize: str = "calibrated"

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.window < 1:
            raise ValueError(f"pFedSeq needs warmup >= 0 and window >= 1, got {self.warmup}, {self.window}")
        if self.learner not in KINDS:
            raise ValueError(f"pFedSeq learner must be one of {list(KINDS)}, got {self.learner!r}")
        if not self.learner_lr > 0 or self.chunk < 1:
            raise ValueError(f"pFedSeq needs learner_lr > 0 and chunk >= 1, got {self.learner_lr}, {self.chunk}")
        if self.server_device not in ("auto", "cpu", "cuda") and not self.server_device.startswith("cuda:"):
            raise ValueError(f"server_device must be auto, cpu or cuda[:i], got {self.server_device!r}")
        if self.personalize not in ("calibrated", "trained"):
            raise ValueError(f"pFedSeq personalize must be calibrated or trained, got {self.personalize!r}")
        if not isinstance(self.aggregation, bool) or not isinstance(self.cross_client, bool):
            raise ValueError("pFedSeq aggregation and cross_client must be true or false")
        if len(set(self.clients)) != len(self.clients):
            raise ValueError(f"pFedSeq clients list has duplicates: {list(self.clients)}")

    @classmethod
    def from_options(cls, o: Mapping[str, Any]) -> PFedSeqConfig:
        """Build from method options (unknown keys such as ``seed`` are ignored)."""
        kwargs = {k: o[k] for k in cls.__dataclass_fields__ if k in o and o[k] is not None}
        if isinstance(kwargs.get("clients"), str):
            kwargs["clients"] = [c for c in kwargs["clients"].split(",") if c]
        kwargs["clients"] = tuple(kwargs.get("clients", ()))
        for name in ("warmup", "window", "layers", "d_state", "expand", "d_conv", "mlp_hidden", "chunk"):
            if name in kwargs:
                kwargs[name] = int(kwargs[name])
        for name in ("learner_lr", "max_grad_norm"):
            if name in kwargs:
                kwargs[name] = float(kwargs[name])
        return cls(**kwargs)


# Paper 003 section 5 (Implementation): SGD, lr 0.005, batch 32, 1 local epoch, T = 80 rounds; the warm-up W
# counts rounds, so a shorter budget scales it with the rounds.
REGIME = Regime(optimizer="sgd", lr=0.005, schedule="constant", batch_size=32, local_epochs=1, rounds=80,
                round_options=("warmup",), source="paper 003 s5 (SGD 0.005, batch 32, 1 epoch, T=80)")
RECEIVED = "received_checksum"
VERSION = 2  # of the strategy state: 1 packed the tensors as base64 text


def checksum(state: Mapping[str, torch.Tensor]) -> float:
    """Sum of every entry in float64: the client echoes it so the server knows what it trained from."""
    return float(sum(float(v.detach().double().sum()) for v in state.values()))


class PFedSeqStrategy(FedAvgStrategy):
    """Server: FedAvg by data size, update history, per-layer learners, per-client calibrated adapters."""

    def __init__(self, cfg: PFedSeqConfig, seed: int = 0) -> None:
        super().__init__(seed=seed, weighting="num_examples")
        self.cfg = cfg
        # auto: the device setting until initial_state() knows the run's model, then that model's device
        self.device = settings.resolve_device(None if cfg.server_device == "auto" else cfg.server_device)
        self.roster: list[str] = list(cfg.clients)
        self.layout: Layout | None = None
        self.history = UpdateHistory(cfg.window)
        self.calib: torch.Tensor | None = None  # [N, D] sent after the last round; None: the plain global
        self.bases: torch.Tensor | None = None  # [N, D] ablation A: each client's own theta_hat, not the global
        self.learners: nn.ModuleList | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._metrics: dict[str, float] = {}
        self._sent: dict[str, float] = {}  # checksum of what each client was sent this round

    def initial_state(self, runtime: Runtime) -> StateDict:
        if self.cfg.server_device == "auto":
            self.device = runtime.device  # the learners run where the run's model runs
        return super().initial_state(runtime)

    def _check_roster(self, clients: Sequence[str]) -> None:
        if not self.roster:
            self.roster = list(clients)
        unknown = [c for c in clients if c not in self.roster]
        if unknown:
            raise ValueError(f"pFedSeq's learner has one channel per client of {self.roster}; {unknown} joined later. "
                             "Pass every client with --option clients=a,b,c (or sample all clients in round 0)")

    def _build(self, layout: Layout) -> None:
        self.layout = layout
        with torch.random.fork_rng(devices=[]):  # learner init from the run seed, the global RNG untouched
            torch.manual_seed(derive_seed(self.seed, "pfedseq-learner"))
            channels = len(self.roster) if self.cfg.cross_client else 1
            learners = [make_learner(self.cfg.learner, channels, self.cfg.window, layers=self.cfg.layers,
                                     d_state=self.cfg.d_state, expand=self.cfg.expand, d_conv=self.cfg.d_conv,
                                     hidden=self.cfg.mlp_hidden, backend=self.cfg.scan) for _ in layout.groups]
            self.learners = nn.ModuleList(learners if self.cfg.cross_client else [OwnSequence(m) for m in learners])
        self.learners.to(self.device)
        self.optimizer = torch.optim.Adam(self.learners.parameters(), lr=self.cfg.learner_lr)

    def _theta(self, i: int, base: torch.Tensor) -> torch.Tensor:
        """Client i's personalized adapter (flat): its base (the global, or ablation A's own) + its calibration."""
        theta = base if self.bases is None else self.bases[i]
        return theta if self.calib is None else theta + self.calib[i]

    def configure_round(self, round_idx: int, clients: list[str], state: StateDict) -> dict[str, FitIns]:
        self._check_roster(clients)
        if (self.calib is None and self.bases is None) or self.layout is None:
            out = {c: FitIns(round=round_idx, state=state, config={"personalized": False}) for c in clients}
        else:
            base = self.layout.flatten(state, self.device)
            out = {}
            for c in clients:
                theta = self.layout.unflatten(self._theta(self.roster.index(c), base))
                out[c] = FitIns(round=round_idx, state={k: v.to(state[k].dtype) for k, v in theta.items()},
                                config={"personalized": True})
        self._sent = {c: checksum(ins.state) for c, ins in out.items()}
        return out

    def check_upload(self, ins: FitIns, res: FitRes) -> str | None:
        """An update of the adapter sent (its keys, shapes, dtypes) trained from exactly what was sent."""
        problem = super().check_upload(ins, res)
        if problem is not None:
            return problem
        try:
            self._check_received(res)
        except ValueError as exc:
            return str(exc)
        return None

    def _check_received(self, res: FitRes) -> None:
        # theta_hat = sent + Delta is only right if the client trained from what was sent: a runtime that
        # broadcasts the global instead of each client's FitIns would silently corrupt the learner.
        got, want = res.metrics.get(RECEIVED), self._sent.get(res.client_id)
        if got is not None and want is not None and abs(got - want) > 1e-5 * (1.0 + abs(want)):
            raise ValueError(f"client {res.client_id} trained from another adapter than pFedSeq sent it "
                             f"(checksum {got:.6g} != {want:.6g}); the runtime must deliver configure_round's FitIns")

    def aggregate(self, round_idx: int, results: list[FitRes], failures: list[tuple[str, str]],
                  state: StateDict) -> StateDict | None:
        if not results:
            return None
        began = time.perf_counter()
        ids = [r.client_id for r in results]
        if len(set(ids)) != len(ids):
            raise ValueError(f"pFedSeq got two uploads from one client in round {round_idx}: {ids}")
        self._check_roster(ids)
        if self.layout is None:
            self._build(Layout.from_state(state))
        assert self.layout is not None and self.learners is not None and self.optimizer is not None
        base = self.layout.flatten(state, self.device)
        step = torch.zeros(len(self.roster), self.layout.size, device=self.device)  # absent clients: zero
        updated = []
        for res in results:
            self._check_received(res)
            i = self.roster.index(res.client_id)
            step[i] = self.layout.flatten(res.state, self.device)
            sent = self._theta(i, base)
            updated.append({"v": (sent + step[i]).cpu()})  # theta_hat_i = theta_i^{t-1} + Delta_i^t
            if not self.cfg.aggregation:  # ablation A: the client's own adapter is its next base
                bases = base.expand(len(self.roster), -1).clone() if self.bases is None else self.bases
                bases[i] = sent + step[i]
                self.bases = bases
        merged = weighted_average(updated, [float(r.num_examples) for r in results])
        assert merged is not None
        groups = self.layout.groups
        grad_norm = 0.0
        if len(self.history):  # eq 5 on the previous window (the input of the calibrations just sent)
            grad_norm = learner_step(list(self.learners), groups, self.history.steps, step, self.optimizer,
                                     self.cfg.chunk, self.cfg.max_grad_norm)
        self.history.push(step)
        personalized = round_idx + 1 > self.cfg.warmup
        self.calib = None
        if personalized:
            self.calib = torch.cat([calibrate(learner, self.history.steps, s, e, self.cfg.chunk)
                                    for learner, (_, s, e) in zip(self.learners, groups, strict=True)], dim=1)
        self._metrics = {"personalized_next": float(personalized), "learner_grad_norm": grad_norm,
                         "update_rms": float(step.pow(2).mean().sqrt()),
                         "calib_rms": float(self.calib.pow(2).mean().sqrt()) if self.calib is not None else 0.0,
                         "server_seconds": round(time.perf_counter() - began, 4)}
        out = self.layout.unflatten(merged["v"])
        return {k: v.to(state[k].dtype) for k, v in out.items()}

    def personal_state(self, client_id: str, state: StateDict) -> StateDict | None:
        """Algorithm 1's personalized adapter of ``client_id``: the final global plus its last calibration."""
        if self.layout is None or client_id not in self.roster:
            return None
        base = self.layout.flatten(state, self.device)
        theta = self.layout.unflatten(self._theta(self.roster.index(client_id), base))
        return {k: v.to(state[k].dtype) for k, v in theta.items()}

    def evaluate(self, round_idx: int, state: StateDict) -> dict[str, float] | None:
        return dict(self._metrics) or None

    def state_dict(self) -> dict[str, Any]:
        """The roster, layout, update history, learners, Adam state and sent calibrations (tensors as they are).

        Like ``nn.Module.state_dict`` the tensors are the live ones: the checkpoint writes them to
        safetensors (:mod:`training.federation.checkpoint`) before the next round changes them.
        """
        data: dict[str, Any] = {"version": VERSION, "roster": list(self.roster)}
        if self.layout is None or self.learners is None or self.optimizer is None:
            return data
        opt = self.optimizer.state_dict()
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in opt["param_groups"]]
        return {**data, "layout": self.layout.asdict(), "history": list(self.history.steps),
                "learners": dict(self.learners.state_dict()),
                "adam": {"state": {str(i): dict(slot) for i, slot in opt["state"].items()}, "param_groups": groups},
                "calib": self.calib, "bases": self.bases}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (as :func:`training.federation.checkpoint.load_round` returns it).

        Raises:
            ValueError: the state is from another version (version 1 kept its tensors as base64 text), or its
                history does not fit this configuration.
        """
        version = data.get("version")
        if version != VERSION:
            raise ValueError(f"pFedSeq strategy state version {version!r} is not {VERSION} (version 1 checkpoints, "
                             "with base64 tensors in strategy.json, cannot be resumed; start the run again)")
        self.roster = list(data["roster"])
        if "layout" not in data:
            return
        self._build(Layout.from_dict(data["layout"]))
        assert self.learners is not None and self.optimizer is not None
        self.history.load([t.to(self.device) for t in data["history"]])
        self.learners.load_state_dict(data["learners"])
        # clone: Optimizer.load_state_dict keeps tensors already on the right device, and Adam updates them in place
        slots = {int(i): {k: v.clone() for k, v in slot.items()} for i, slot in data["adam"]["state"].items()}
        groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in data["adam"]["param_groups"]]
        self.optimizer.load_state_dict({"state": slots, "param_groups": groups})
        self.calib = None if data["calib"] is None else data["calib"].to(self.device)
        self.bases = None if data.get("bases") is None else data["bases"].to(self.device)

    def summary(self) -> dict[str, Any]:
        return {"aggregation": "num_examples", "learner": self.cfg.learner, "warmup": self.cfg.warmup,
                "window": self.cfg.window, "server_device": str(self.device), "clients": list(self.roster)}


class PFedSeqClient(ClientAlgorithm):
    """Client: train the received (calibrated) adapter, upload the update; personalize per Algorithm 1."""

    def __init__(self, personalize: str = "calibrated") -> None:
        self.personalize = personalize

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        trained, metrics = train_global(ins, ctx)
        ctx.private["local"] = trained  # theta_hat_i^t: the client's personalized adapter so far
        delta = {k: trained[k] - ins.state[k].to(trained[k].dtype) for k in trained}
        return FitRes(ctx.client_id, delta, len(ctx.data.train), {**metrics, RECEIVED: checksum(ins.state)})

    def finalize(self, state: StateDict, ctx: ClientContext) -> dict[str, float]:
        """``state`` is the server's personalized adapter for this client (global + last calibration)."""
        if self.personalize == "calibrated":
            ctx.private["local"] = {k: v.detach().clone() for k, v in state.items()}
            return {}
        if "local" not in ctx.private:  # never sampled: personalize from the final global like FedIT-FT
            return train_local(ctx, round_idx=-1, start=state, phase="finetune")
        return {}


def _strategy(o: Mapping[str, Any]) -> PFedSeqStrategy:
    return PFedSeqStrategy(PFedSeqConfig.from_options(o), seed=int(o.get("seed", 0)))


def _option(name: str, kind: type, help: str, listed: bool = True, **limits: Any) -> Option:
    """A :class:`PFedSeqConfig` field as a method option (its default is the dataclass's: one source)."""
    return Option(name, kind, getattr(PFedSeqConfig, name), help, listed=listed, **limits)


OPTIONS = (  # the module docstring says each one's meaning; PFedSeqConfig.__post_init__ checks them together
    _option("warmup", int, "FedAvg rounds before the learners start, W", low=0),
    _option("window", int, "updates each learner sees, L (1: ablation B)", low=1),
    _option("learner", str, "ssm, lstm (ablation E) or mlp (ablation D)", choices=tuple(KINDS)),
    _option("learner_lr", float, "the learners' Adam learning rate", low=0, open_low=True),
    _option("layers", int, "learner layers", low=1),
    _option("d_state", int, "SSM state size, M", low=1),
    _option("expand", int, "SSM expansion", low=1),
    _option("d_conv", int, "SSM convolution width", low=1),
    _option("mlp_hidden", int, "hidden width of the mlp learner", low=1, listed=False),
    _option("max_grad_norm", float, "the learners' gradient clipping (null: none)", low=0, open_low=True,
            nullable=True, listed=False),
    _option("chunk", int, "coordinates per learner pass", low=1),
    _option("scan", str, "the SSM scan: auto, torch or kernel (mamba-ssm)", choices=("auto", "torch", "kernel")),
    _option("server_device", str, "auto (the run's device), cpu or cuda[:i]", listed=False),
    _option("clients", list, "the roster, the learner's channels in order (default: the first round's)",
            listed=False),
    _option("aggregation", bool, "false: ablation A (no global aggregation)"),
    _option("cross_client", bool, "false: ablation C (each client's calibration from its own updates)"),
    _option("personalize", str, "calibrated (the server's) or trained (a local fine-tune)",
            choices=("calibrated", "trained")),
)
PFEDSEQ = Method(
    name="pfedseq", strategy=_strategy, client=lambda o: PFedSeqClient(str(o.get("personalize", "calibrated"))),
    has_local=True, inference_weight=1.0,
    options=OPTIONS,
    regime=REGIME,
)
