"""The client/server contract every federated method implements (in the spirit of Flower's strategies).

A method is one module with both halves side by side: a :class:`Strategy` (server: what each selected
client receives, how uploads are aggregated, what is reported) and a :class:`ClientAlgorithm` (client:
one local update from what it received, plus an optional final personalization step). The runtime
(in-process simulator or Flower) moves only :class:`FitIns` and :class:`FitRes` between them; a
client's private state (its local adapter, history) lives in :class:`ClientContext.private` and never
leaves the client (paper 000 Table 12: only the global adapter travels). The tensors that travel and the
seeds every random choice derives from are :mod:`training.state`'s; :func:`layout_problem` is the default
check of an upload's layout.

Round loop (:mod:`training.federation.rounds`, one for every runtime, not owned by methods)::

    state = strategy.initial_state(runtime)
    for r in rounds:
        ins = strategy.configure_round(r, sampled_clients, state)          # server -> clients
        results = [client.fit(ins[c], context[c]) for c in sampled]         # on the clients
        state = strategy.aggregate(r, results, failures, state) or state    # server
        strategy.evaluate(r, state)                                         # optional
    client.finalize(state, context[c]) for every client                     # personalization
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from training.options import Option, check_options, declared_defaults
from training.state import ClientState, StateDict, state_bytes

if TYPE_CHECKING:
    from adapters.rundir import RunDir
    from training.data import ClientData
    from training.local.regime import Regime
    from training.local.runtime import Runtime


def layout_problem(expected: Mapping[str, torch.Tensor], got: Mapping[str, Any], what: str = "upload") -> str | None:
    """Why ``got`` does not have exactly ``expected``'s keys, shapes and dtypes, or None when it does."""
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing:
        return f"{what} lacks {len(missing)} tensor(s), e.g. {missing[:2]}"
    if extra:
        return f"{what} has {len(extra)} unexpected tensor(s), e.g. {extra[:2]}"
    for key, ref in expected.items():
        value = got[key]
        if not isinstance(value, torch.Tensor):
            return f"{what} {key} is a {type(value).__name__}, not a tensor"
        if tuple(value.shape) != tuple(ref.shape):
            return f"{what} {key} has shape {tuple(value.shape)}, expected {tuple(ref.shape)}"
        if value.dtype != ref.dtype:
            return f"{what} {key} has dtype {value.dtype}, expected {ref.dtype}"
    return None


@dataclass(frozen=True)
class FitIns:
    """What the server sends one client for one round.

    Attributes:
        round: the round index (0-based; round 0 is FedDPA-T's global-only round).
        state: the tensors sent (normally the global adapter, ``{"<path>.lora_A": ...}``).
        config: per-round settings (learning rate, phase flags) the client must honour.
    """

    round: int
    state: StateDict
    config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FitRes:
    """What one client uploads after its local update.

    Attributes:
        client_id: who sent it.
        state: the uploaded tensors (only what the method shares; never a private adapter).
        num_examples: local training examples (the ``num_examples`` aggregation weight).
        metrics: scalars for the log (loss, steps, regulariser values).
    """

    client_id: str
    state: StateDict
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """Upload size in bytes (tensor payload of ``state``; 0 for methods that share nothing)."""
        return state_bytes(self.state)


@dataclass
class ClientContext:
    """Everything a client may touch during ``fit``: its data, the shared runtime, its private state.

    Attributes:
        client_id: the client.
        data: its local data (training examples and task).
        runtime: the base model with injected adapters, tokenizer and training settings.
        private: named private tensors kept across rounds (persisted by the runtime, never uploaded).
        seed: the run's seed; methods derive every random choice from (seed, round, client).
    """

    client_id: str
    data: ClientData
    runtime: Runtime
    private: ClientState = field(default_factory=dict)
    seed: int = 0


class Strategy(ABC):
    """Server half of a method."""

    @abstractmethod
    def initial_state(self, runtime: Runtime) -> StateDict:
        """The state before round 0 (e.g. a freshly initialised global adapter)."""

    def configure_round(self, round_idx: int, clients: list[str], state: StateDict) -> dict[str, FitIns]:
        """Instructions for each selected client; by default everyone gets the same state."""
        return {c: FitIns(round=round_idx, state=state) for c in clients}

    @abstractmethod
    def aggregate(self, round_idx: int, results: list[FitRes], failures: list[tuple[str, str]],
                  state: StateDict) -> StateDict | None:
        """New server state from the round's uploads; None keeps ``state`` (nothing to aggregate)."""

    def check_upload(self, ins: FitIns, res: FitRes) -> str | None:
        """Why ``res`` is not a well-formed upload for ``ins`` (None: it is), checked before :meth:`aggregate`.

        The default wants exactly the tensors sent: same keys, shapes and dtypes (a method uploading
        something else overrides it). Finiteness, ``num_examples`` and metrics are checked for every
        method by :func:`training.federation.validation.reply_problem`.
        """
        return layout_problem(ins.state, res.state)

    def evaluate(self, round_idx: int, state: StateDict) -> dict[str, float] | None:
        """Optional server-side evaluation after aggregation; its scalars go to the round's metrics row."""
        del round_idx, state
        return None

    def personal_state(self, client_id: str, state: StateDict) -> StateDict | None:
        """After the last round: what the server holds as ``client_id``'s personalised model, if anything.

        None (the default): the client personalises from the final ``state`` itself (``finalize``).
        pFedSeq returns Algorithm 1's aggregated global plus the client's last calibration.
        """
        del client_id, state
        return None

    def state_dict(self) -> dict[str, Any]:
        """Server-side state for checkpoints: JSON data, torch tensors allowed at any depth (saved to
        ``strategy.safetensors``); empty for stateless strategies."""
        return {}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore :meth:`state_dict` on resume."""

    def summary(self) -> dict[str, Any]:
        """A short description for run.json and the end-of-run report."""
        return {}


class ClientAlgorithm(ABC):
    """Client half of a method."""

    @abstractmethod
    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        """One local update from ``ins``; returns only what the method uploads."""

    def finalize(self, state: StateDict, ctx: ClientContext) -> dict[str, float]:
        """After the last round: build the client's personalized adapter in ``ctx.private`` (optional).

        Returns:
            The personalization's metrics (a fine-tune's ``finetune_loss`` ...), empty when it trains nothing;
            the round loop writes them to ``metrics.jsonl`` as the client's ``finalize`` row.
        """
        return {}


# After the last round, a method with its own model layout writes it (FedAMoLE's experts and assignments):
# ``(run, runtime, state, strategy)``, the strategy being the method's own server half.
ExportFn = Callable[["RunDir", "Runtime", StateDict, "Strategy"], None]


@dataclass(frozen=True)
class Method:
    """A registered method: its two halves, what it produces, and how its clients infer.

    Attributes:
        name: the CLI name (``fedit``, ``feddpa-t`` ...).
        strategy: builds the server half from the method options.
        client: builds the client half from the method options.
        regime: the paper's client training (optimizer, lr and its decay, batch, epochs or steps, rounds),
            defined in the method's module; FedDPA's (``FEDDPA_REGIME``) or the baselines'
            (``BASELINE_REGIME``) for the methods without a paper regime of their own
            (:mod:`training.local.regime`).
        has_local: clients end with a private ``local`` adapter.
        inference_weight: FedDPA's lambda: the personalized model mixes (global, local) at
            ``(1 - a, a)``; 1.0 is the local adapter alone; None: the global alone.
        options: the method's declared options (:class:`training.options.Option`: type, range, default,
            help), the one place they are defined; :attr:`defaults` and the check of a user's options
            (:meth:`check_options`) read it.
        centralized: pool every client's data into one trainer (the Centralized baseline).
        inference_option: the option whose value overrides ``inference_weight`` (FedDPA's alpha).
        export: writes the final model in a method-specific layout (:data:`ExportFn`) instead of the
            global/local PEFT folders (FedAMoLE's experts and assignments); None: the PEFT folders.
        instance_weighting: the personalised model mixes (global, local) with FedDPA's instance-wise
            weight (paper 000 section 4.3), so training ends by saving each client's local-instance
            embeddings for the router; other methods' clients answer with their local adapter alone.
        data_defaults: option defaults a paper sets per data set, by data spec (FedDPA-T: alpha 0.3
            on ``feddpa2``, paper 000 s5.1), keyed on :func:`training.data.data_key` (a benchmark's name, also for
            a folder holding its files); between ``defaults`` and the user's options.
        client_defaults: ``n_clients -> options``: defaults that scale with the number of clients (FedAMoLE's
            expert count), applied where the clients are known, before the user's options.
    """

    name: str
    strategy: Callable[[Mapping[str, Any]], Strategy]
    client: Callable[[Mapping[str, Any]], ClientAlgorithm]
    regime: Regime
    has_local: bool = False
    inference_weight: float | None = None
    options: tuple[Option, ...] = ()
    centralized: bool = False
    inference_option: str | None = None
    export: ExportFn | None = None
    instance_weighting: bool = False
    data_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    client_defaults: Callable[[int], Mapping[str, Any]] | None = None

    @property
    def defaults(self) -> dict[str, Any]:
        """The paper's option values: the declared options' defaults (those listed, :class:`Option`)."""
        return declared_defaults(self.options)

    def check_options(self, options: Mapping[str, Any], where: str = "--option") -> dict[str, Any]:
        """``options`` under their declared names (:func:`training.options.check_options`).

        Raises:
            OptionError: an undeclared key or a bad value (naming the closest key, or the expected range).
        """
        return check_options(self.name, self.options, options, where)

    def options_for(self, data: str | None, options: Mapping[str, Any] | None = None,
                    n_clients: int | None = None) -> dict[str, Any]:
        """The options on data set ``data`` with ``n_clients``: defaults, the data set's and the client
        count's, then ``options``."""
        scaled = self.client_defaults(n_clients) if self.client_defaults and n_clients else {}
        return {**self.defaults, **self.data_defaults.get(data or "", {}), **scaled, **(options or {})}

    def mixture_weight(self, options: Mapping[str, Any]) -> float | None:
        """The local adapter's inference weight under ``options``."""
        if self.inference_option and self.inference_option in options:
            return float(options[self.inference_option])
        return self.inference_weight

