"""The RSEA expert-assignment MILP of one module: feasibility, solving, verification.

FedAMoLE (paper 002, section 4.4 and Appendix C.3, Definition C.1 with the selection probabilities
of equation (28); docs/methods.md 1.5). With P (N_e x N_c) the selection probabilities and X in {0,1}:

    maximise  sum_{j,i} P[j, i] X[j, i]
    s.t.      sum_i X[j, i] = k_c                 every expert reverse-selects k_c clients
              e_min <= sum_j X[j, i] <= e_max     every client holds e_min..e_max experts
              (homogeneous ablation: sum_j X[j, i] = N_e k_c / N_c exactly, bounds ignored)

The constraint matrix is the incidence matrix of a bipartite graph (a transportation problem), so
it is totally unimodular and the LP relaxation already has integral optima; HiGHS through
``scipy.optimize.milp`` solves it exactly in milliseconds. SCIP (the reference's solver) is
optional.
Infeasible settings are refused before solving, and every solution is re-checked.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

Solver = Literal["highs", "scip"]
_INTEGRALITY_TOL = 1e-6


def client_bounds(
    num_experts: int,
    num_clients: int,
    k_c: int,
    e_min: int,
    e_max: int,
    homogeneous: bool = False,
) -> tuple[int, int]:
    """Check that an assignment exists and return the per-client expert-count bounds.

    Together the checks are also sufficient: a round-robin placement (expert j takes clients
    ``j*k_c, ..., j*k_c + k_c - 1`` mod N_c) gives every client floor or ceil of N_e k_c / N_c.

    Args:
        num_experts: N_e domain experts in the module.
        num_clients: N_c clients.
        k_c: clients each expert selects.
        e_min: fewest experts per client.
        e_max: most experts per client.
        homogeneous: every client gets exactly N_e k_c / N_c experts instead of the bounds.

    Returns:
        ``(lo, hi)``, the bounds on every client's expert count.

    Raises:
        ValueError: naming the numbers that make the setting infeasible.
    """
    if num_experts < 1 or num_clients < 1:
        raise ValueError(
            f"need N_e >= 1 experts and N_c >= 1 clients, got {num_experts}, {num_clients}"
        )
    if k_c < 1:
        raise ValueError(f"k_c = {k_c}: every expert must select at least one client")
    if k_c > num_clients:
        raise ValueError(
            f"k_c = {k_c} clients per expert exceeds the N_c = {num_clients} clients available"
        )
    slots = num_experts * k_c
    if homogeneous:
        if slots % num_clients:
            raise ValueError(
                f"homogeneous assignment needs the N_e*k_c = {slots} expert slots to divide evenly "
                f"over N_c = {num_clients} clients ({slots}/{num_clients} is not an integer)"
            )
        quota = slots // num_clients
        return quota, quota
    if e_min < 0:
        raise ValueError(f"e_min = {e_min} must be >= 0")
    if e_min > e_max:
        raise ValueError(f"e_min = {e_min} exceeds e_max = {e_max}")
    if slots > num_clients * e_max:
        raise ValueError(
            f"N_e*k_c = {slots} expert slots cannot be placed on N_c = {num_clients} clients with "
            f"at most e_max = {e_max} each (max {num_clients * e_max})"
        )
    if slots < num_clients * e_min:
        # Also covers e_min > N_e, since slots <= N_e * N_c once k_c <= N_c.
        raise ValueError(
            f"N_e*k_c = {slots} expert slots cannot give N_c = {num_clients} clients at least "
            f"e_min = {e_min} each (needs {num_clients * e_min})"
        )
    return e_min, min(e_max, num_experts)


def milp_constraints(
    num_experts: int, num_clients: int, k_c: int, lo: int, hi: int
) -> list[LinearConstraint]:
    """Return the two constraint blocks on the row-major flattening ``x[j * N_c + i] = X[j, i]``."""
    ones_c = np.ones((1, num_clients))
    ones_e = np.ones((1, num_experts))
    per_expert = sparse.kron(sparse.identity(num_experts), ones_c, format="csr")  # (N_e, N_e*N_c)
    per_client = sparse.kron(ones_e, sparse.identity(num_clients), format="csr")  # (N_c, N_e*N_c)
    return [LinearConstraint(per_expert, k_c, k_c), LinearConstraint(per_client, lo, hi)]


def _solve_highs(P: np.ndarray, k_c: int, lo: int, hi: int) -> np.ndarray:
    n_e, n_c = P.shape
    res = milp(
        c=-P.ravel(),  # milp minimises
        constraints=milp_constraints(n_e, n_c, k_c, lo, hi),
        integrality=np.ones(n_e * n_c),
        bounds=Bounds(0, 1),
    )
    if not res.success or res.x is None:
        raise RuntimeError(
            f"HiGHS did not solve the assignment: status {res.status}, {res.message}"
        )
    return np.asarray(res.x).reshape(n_e, n_c)


def _solve_scip(P: np.ndarray, k_c: int, lo: int, hi: int) -> np.ndarray:
    try:
        from pyscipopt import Model, quicksum
    except ImportError as err:
        raise ImportError(
            "solver='scip' needs the optional package 'pyscipopt' (pip install pyscipopt); "
            "the default solver='highs' needs only scipy"
        ) from err
    n_e, n_c = P.shape
    model = Model("rsea")
    model.hideOutput()
    x = {(j, i): model.addVar(vtype="B", name=f"x_{j}_{i}") for j in range(n_e) for i in range(n_c)}
    model.setObjective(
        quicksum(float(P[j, i]) * x[j, i] for j in range(n_e) for i in range(n_c)), "maximize"
    )
    for j in range(n_e):
        model.addCons(quicksum(x[j, i] for i in range(n_c)) == k_c)
    for i in range(n_c):
        load = quicksum(x[j, i] for j in range(n_e))
        model.addCons(load >= lo)
        model.addCons(load <= hi)
    model.optimize()
    if model.getStatus() != "optimal":
        raise RuntimeError(f"SCIP did not solve the assignment: status {model.getStatus()}")
    return np.array([[model.getVal(x[j, i]) for i in range(n_c)] for j in range(n_e)])


def verify_assignment(X_raw: np.ndarray, k_c: int, lo: int, hi: int) -> np.ndarray:
    """Round a solver's answer to {0, 1} after checking integrality, then re-check every constraint.

    Raises:
        RuntimeError: if the answer is fractional or violates a constraint.
    """
    frac = np.abs(X_raw - np.round(X_raw))
    if frac.max(initial=0.0) > _INTEGRALITY_TOL:
        raise RuntimeError(f"assignment is not integral (max distance {frac.max():.3g} from 0/1)")
    X = np.round(X_raw).astype(np.int64)
    if not np.isin(X, (0, 1)).all():
        raise RuntimeError("assignment has entries outside {0, 1}")
    per_expert = X.sum(axis=1)
    bad = np.flatnonzero(per_expert != k_c)
    if bad.size:
        raise RuntimeError(
            f"experts {bad.tolist()} hold {per_expert[bad].tolist()} clients, not {k_c}"
        )
    per_client = X.sum(axis=0)
    bad = np.flatnonzero((per_client < lo) | (per_client > hi))
    if bad.size:
        raise RuntimeError(
            f"clients {bad.tolist()} hold {per_client[bad].tolist()} experts, outside [{lo}, {hi}]"
        )
    return X


def solve_assignment(
    P: np.ndarray,
    k_c: int = 2,
    e_min: int = 2,
    e_max: int = 8,
    homogeneous: bool = False,
    solver: Solver = "highs",
) -> np.ndarray:
    """Solve the expert-assignment MILP of one module (Appendix C.3).

    Args:
        P: (N_e, N_c) selection probabilities (equation (28): softmax over clients per expert).
        k_c: clients each expert selects (``expert_choices``).
        e_min: fewest experts per client (the reference hard-codes 2).
        e_max: most experts per client (``max_experts``).
        homogeneous: every client gets exactly N_e k_c / N_c experts (ablation ``homo_arch``).
        solver: ``"highs"`` (scipy) or ``"scip"`` (needs pyscipopt).

    Returns:
        (N_e, N_c) int64 matrix in {0, 1}; ``X[j, i] = 1`` assigns expert j to client i.

    Raises:
        ValueError: infeasible settings (before solving) or a malformed ``P``.
        ImportError: ``solver="scip"`` without pyscipopt.
        RuntimeError: the solver failed or returned a fractional or infeasible answer.
    """
    P = np.asarray(P, dtype=np.float64)
    if P.ndim != 2:
        raise ValueError(f"P must be (N_e, N_c), got shape {P.shape}")
    if not np.isfinite(P).all():
        raise ValueError("P has non-finite entries")
    n_e, n_c = P.shape
    lo, hi = client_bounds(n_e, n_c, k_c, e_min, e_max, homogeneous)
    if solver == "highs":
        X_raw = _solve_highs(P, k_c, lo, hi)
    elif solver == "scip":
        X_raw = _solve_scip(P, k_c, lo, hi)
    else:
        raise ValueError(f"unknown solver {solver!r}; use 'highs' or 'scip'")
    return verify_assignment(X_raw, k_c, lo, hi)
