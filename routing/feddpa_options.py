"""FedDPA's serving options, defined once: how ``<client>`` targets are weighted (paper 000 section 4.3).

:class:`FedDPAOptions` is the one definition of each option: its name, type, default, help text (the
``help`` metadata of its field) and checks. The edges spell it their way and derive the rest from it:
``fedmosaic serve --feddpa-<name>`` (the flags are made from these fields), the setting
``FEDMOSAIC_SERVE_FEDDPA_<NAME>`` (``serving.settings.ServeSettings``, its default and description taken
from here), and ``fedmosaic eval``. The serving stack receives one :class:`FedDPAOptions` in its config
and builds the instance-wise router from it (:meth:`FedDPAOptions.router`); the engine sees only the
``weight_fn`` that router answers through, and ``prefill`` decides whether a routed prompt is
prefilled again with its routed weights (``exact_prefill`` on the engine request).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from routing.base import Pooling, RoutingError
from routing.embedding import check_pooling
from routing.feddpa import FedDPARouter, Mode, Similarity, Variant, Weighting, resolve_weighting, similarity_name

Routing = Literal["instance", "fixed"]
Rule = Literal["paper", "calibrated", "fixed"]
Prefill = Literal["exact", "once"]


def _option(default: Any, help: str) -> Any:  # noqa: A002 - argparse's word
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class FedDPAOptions:
    """How ``<client>`` targets are weighted and prefilled; every field's ``help`` is its documentation.

    Raises (on construction):
        RoutingError: a value outside its choices, ``samples`` below 1, or the calibrated weighting asked
            for together with an ablation of the paper's rule (another similarity, the reference variant).
    """

    routing: Routing = _option("instance", "<client> targets: instance-wise weights from the run's embeddings "
                               "(default), or the run's fixed weight (older spelling of --feddpa-weighting)")
    weighting: Rule | None = _option(None, "<client> weighting: calibrated (default; docs/feddpa-weighting.md), "
                                     "paper (lambda * mean cosine) or fixed (the run's alpha); "
                                     "unset: follows routing (instance: calibrated, paper for an ablation)")
    samples: int = _option(5, "S, the client's local instances each request is compared with")
    mode: Mode = _option("random", "S drawn at random (the paper) or the S nearest (knn)")
    similarity: Similarity = _option("cosine", "similarity of the prompt to the client's instances: cosine "
                                     "(paper), neg-l2 or pearson (paper 000 Table 9; default weighting then paper)")
    variant: Variant = _option("paper", "paper: a weights the local adapter; reference: the FedDPA reference "
                               "code's assignment, a weights the global adapter (default weighting then paper)")
    embedding: Pooling = _option("last", "the prompt's final-layer state: last token (paper) or mean over its "
                                 "tokens (paper 000 Table 10; needs the run's indexes rebuilt by "
                                 "`fedmosaic calibrate RUN --feddpa-embedding mean`)")
    prefill: Prefill = _option("exact", "exact: a <client> prompt is prefilled again with its routed weights "
                               "(the paper's rule for every token); once: the routing pass's KV cache (global "
                               "adapter) is kept and only decoding uses the routed weights (faster, not exact)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "similarity", similarity_name(self.similarity))  # neg-l2 spelled either way
        for name, allowed in choices().items():
            if getattr(self, name) not in allowed:
                raise RoutingError(f"FedDPA {name} must be one of {allowed}, got {getattr(self, name)!r}")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise RoutingError(f"FedDPA samples (S) must be an integer >= 1, got {self.samples!r}")
        check_pooling(self.embedding)
        if self.instance:
            _ = self.rule  # refuses calibrated together with an ablation, before anything loads

    @property
    def instance(self) -> bool:
        """True when ``<client>`` targets get instance-wise weights (a ``weighting`` wins over ``routing``)."""
        return self.weighting in ("paper", "calibrated") or (self.weighting is None and self.routing == "instance")

    @property
    def rule(self) -> Weighting:
        """The instance-wise rule: ``weighting`` as given, else calibrated (the paper's for an ablation)."""
        return resolve_weighting(self.weighting if self.weighting != "fixed" else None, self.similarity, self.variant)

    def router(self, lambda_: float, seed: int | None = 0, rule: Weighting | None = None) -> FedDPARouter:
        """The FedDPA rule these options ask for, scaled by ``lambda_`` (``rule`` overrides :attr:`rule`)."""
        return FedDPARouter(lambda_=lambda_, S=self.samples, mode=self.mode, seed=seed, weighting=rule or self.rule,
                            similarity=self.similarity, variant=self.variant, embedding=self.embedding)


def choices() -> dict[str, tuple[str, ...]]:
    """Each option with a fixed set of values: its values (None allowed where the type says so)."""
    hints = typing.get_type_hints(FedDPAOptions)
    out: dict[str, tuple[Any, ...]] = {}
    for f in dataclasses.fields(FedDPAOptions):
        args = typing.get_args(hints[f.name])
        literal = [a for a in args if typing.get_origin(a) is Literal]
        if typing.get_origin(hints[f.name]) is Literal:
            out[f.name] = args
        elif literal:  # Optional[Literal[...]]
            out[f.name] = (*typing.get_args(literal[0]), None)
    return out


def option_help(name: str) -> str:
    """The help text of option ``name``."""
    return str(FedDPAOptions.__dataclass_fields__[name].metadata["help"])


def option_default(name: str) -> Any:
    """The default of option ``name``."""
    return FedDPAOptions.__dataclass_fields__[name].default


def option_type(name: str) -> type:
    """The Python type of option ``name``'s values on a command line (``str`` for a choice)."""
    return int if typing.get_type_hints(FedDPAOptions)[name] is int else str


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(FedDPAOptions))


def add_option_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...] = OPTION_NAMES,
                         env: str | None = None) -> None:
    """Add ``--feddpa-<name>`` for each option in ``names``: help, choices and type from its one definition.

    Args:
        parser: the command's parser.
        names: the options it takes.
        env: the environment variables' prefix when the command also reads settings from them
            (``FEDMOSAIC_SERVE_FEDDPA_``): its options then default to None, so that one left out never
            overrides the environment; without one, each defaults to the option's default.
    """
    allowed = choices()
    for name in names:
        values = [str(v).replace("_", "-") for v in allowed.get(name, ()) if v is not None] or None
        default = option_default(name)
        told = f" (default {str(default).replace('_', '-')})" if default is not None else ""
        where = f"; env {env}{name.upper()}" if env else ""
        parser.add_argument(f"--feddpa-{name}", choices=values, type=option_type(name),
                            default=None if env else default, help=f"{option_help(name)}{told}{where}")
