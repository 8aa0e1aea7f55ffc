"""FedAMoLE's method options (paper 002, docs/methods.md 1.6): each an :class:`AMoLEConfig` field, declared once.

The defaults are the dataclass's own, so the declaration and the config cannot drift; ``AMoLEConfig``'s
``__post_init__`` checks the combinations. The options not listed in ``--help-options`` are the ablation
switches of the paper's Table 4 and the reference code's privacy knobs.
"""

from __future__ import annotations

from typing import Any

from training.algorithms.fedamole.rsea import AMoLEConfig
from training.options import Option


def _option(name: str, kind: type, help: str, listed: bool = True, **limits: Any) -> Option:
    """An :class:`AMoLEConfig` field as a method option (its default is the dataclass's: one source)."""
    return Option(name, kind, getattr(AMoLEConfig, name), help, listed=listed, **limits)


# AMoLEConfig's fields (its __post_init__ checks their combinations); the unlisted ones are ablation switches
OPTIONS = (
    _option("num_experts", int, "domain experts per module, N_e (default: 10 per client)", low=1),
    _option("expert_choices", int, "clients each expert selects per round, k_c", low=1),
    _option("top_k", int, "domain experts per token", low=1),
    _option("min_experts", int, "fewest experts per client-module", low=1),
    _option("max_experts", int, "most experts per client-module", low=1),
    _option("load_balance_alpha", float, "weight of the load-balance loss", low=0),
    _option("assignment", str, "rsea (paper), static (FedMoLE) or random (FedAMoLE-R)",
            choices=("rsea", "static", "random")),
    _option("export", str, "local: each client's last-round experts too; aggregated: the server's pool only",
            choices=("local", "aggregated")),
    _option("router", str, "amole (the paper's gate) or vanilla (FedAMoLE-A)", choices=("amole", "vanilla")),
    _option("shared_expert", bool, "false: the FedAMoLE-S ablation (no shared expert)", listed=False),
    _option("homogeneous", bool, "every client holds N_e k_c / N_c experts", listed=False),
    _option("solver", str, "the MILP solver", listed=False, choices=("highs", "scip")),
    _option("dp_noise", bool, "the reference code's Gamma noise on uploaded embeddings", listed=False),
    _option("dp_eta", float, "rate of the DP noise's Gamma magnitude (larger: less noise)", listed=False, low=0,
            open_low=True),
    _option("embed_noise", float, "Gaussian noise std on uploaded embeddings (0: off)", listed=False, low=0),
)
