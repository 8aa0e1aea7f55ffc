"""One module per federated method, each holding its server and client halves; the registry.

A method with helpers of its own is a folder (``fedamole/``, ``pfedseq/``: its ``method`` module and the
helpers beside it); loss terms several methods share are ``terms/``. Adding a method means adding a module
that defines a :class:`training.protocol.Method` and listing it here (docs/adding-a-method.md:
:mod:`training.algorithms.fedavgm` is the worked example).
"""

from training.algorithms.fedamole.method import FEDAMOLE
from training.algorithms.fedavgm import FEDAVGM
from training.algorithms.feddpa import FEDDPA_F, FEDDPA_T
from training.algorithms.fedit import CENTRALIZED, FEDIT, FEDPROX
from training.algorithms.fedmcp import FEDMCP
from training.algorithms.fedoa import FEDOA
from training.algorithms.local import FEDLORA, LOCAL
from training.algorithms.pfedseq.method import PFEDSEQ
from training.protocol import Method

ALGORITHMS: dict[str, Method] = {
    m.name: m
    for m in (LOCAL, CENTRALIZED, FEDIT, FEDPROX, FEDLORA, FEDDPA_F, FEDDPA_T, FEDOA, FEDMCP, FEDAMOLE, PFEDSEQ,
              FEDAVGM)
}


def get_method(name: str) -> Method:
    """Return a registered method by CLI name."""
    key = name.lower()
    if key not in ALGORITHMS:
        raise ValueError(f"unknown method {name!r}; methods: {sorted(ALGORITHMS)}")
    return ALGORITHMS[key]


__all__ = ["ALGORITHMS", "get_method"]
