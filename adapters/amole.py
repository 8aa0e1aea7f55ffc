"""Pure AMoLE math on tensors: the shape-invariant gate, the routed expert sum, the balance loss.

FedAMoLE (paper 002, section 4.2, equations (4)-(11); Appendix C.1, equations (25)-(27)), as the
reference code computes them (docs/methods.md 1.2-1.3). For one adapted Linear of one client holding E
domain experts (A_j: (r, d), B_j: (o, r)), a shared expert and a token projection P: (r, d):

    e_j = A_j h                        (4)  expert embedding: no dropout, no scaling
    t   = P h                          (5)  token embedding
    z_j = e_j . t / sqrt(r)            (6)
    g   = softmax_j(z)                 (7)  over the E assigned domain experts only
    K   = top-k(g), k = min(top_k, E)  (8)
    w_j = g_j / sum_{l in K} g_l       (9)  renormalised over the selected experts
    y   = W0 h + s B_sh A_sh drop(h) + sum_{j in K} w_j s B_j A_j drop(h)     (10), (11)

Semantics of the routed sum (the naive per-token loop lives in the tests as the reference):

    for n in range(N_tok):
        for slot in range(k):
            j = topk_idx[n, slot]
            y[n] += topk_w[n, slot] * s * B_j @ A_j @ h[n]

FedAMoLE-A (paper 002 section 5.5, ``router="vanilla"``) replaces the shape-invariant gate by a vanilla
MoLE router (Appendix B.1, eq. (24)): one linear router ``W`` (N_e, d) per module over every assignable
expert (so it averages across clients), ``z_j = W_j . h`` for the assigned experts, then the same softmax,
top-k and renormalisation (7)-(9) restricted to them. ``P`` then stands for the assigned rows of ``W``
(E, d). (A softmax over all N_e logits restricted afterwards renormalises to the same top-k weights.)

Two exact ways to compute the routed sum, neither looping over tokens:

* grouped (:func:`amole_delta`, used when dropout is active): the (token, slot) pairs are sorted
  by expert, each expert runs one matmul pair over its contiguous slice (a Python loop over the
  E <= e_max experts only), results are scattered back with ``index_add``; each pair draws its own
  dropout mask, as the reference's per-expert dropout modules do;
* dense (:func:`amole_delta_dense`, no dropout: evaluation, serving, p = 0): the gate already
  computed ``A_j h`` for every assigned expert, so the routed sum is one matmul against the
  concatenated B with the unselected experts' weights at zero. Training may use it too with one
  dropout mask per token shared by the routed experts (``routed_dropout="per_token"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from adapters.dropout import lora_dropout

Router = Literal["amole", "vanilla"]  # the shape-invariant gate, or FedAMoLE-A's vanilla MoLE router
RoutedDropout = Literal["per_expert", "per_token"]


@dataclass(frozen=True)
class AMoLEOutput:
    """Result of :func:`amole_forward`.

    Attributes:
        out: output, shaped like ``base_out``.
        gates_full: (N_tok, E) full softmax over the assigned experts (input of the balance loss).
        topk_idx: (N_tok, k) selected local expert indices (positions in the ``A``/``B`` stacks).
        topk_w: (N_tok, k) renormalised weights of the selected experts.
    """

    out: torch.Tensor
    gates_full: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor


def _check_gate_inputs(h: torch.Tensor, P: torch.Tensor, A: torch.Tensor, top_k: int) -> None:
    E, r, d = A.shape
    if E == 0:
        raise ValueError("AMoLE routing needs at least one assigned domain expert (E = 0)")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if P.shape != (r, d) or h.shape[-1] != d:
        raise ValueError(
            f"shape mismatch: h {tuple(h.shape)}, P {tuple(P.shape)}, A (E={E}, r={r}, d={d})"
        )


def amole_gate(
    h: torch.Tensor, P: torch.Tensor, A_assigned: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route every token over the client's assigned domain experts (equations (4)-(9)).

    Args:
        h: (N_tok, d) token hidden states (the adapted Linear's input, without dropout).
        P: (r, d) token projection weight.
        A_assigned: (E, r, d) stacked A matrices of the E assigned domain experts.
        top_k: experts per token; clipped to E.

    Returns:
        ``(gates_full, topk_idx, topk_w)``: (N_tok, E) softmax, (N_tok, k) indices into the stack,
        (N_tok, k) probabilities renormalised to sum to 1 over the k selected experts.

    Raises:
        ValueError: when no expert is assigned, ``top_k < 1`` or shapes disagree.
    """
    _check_gate_inputs(h, P, A_assigned, top_k)
    E, r, d = A_assigned.shape
    # One (E*r, d) matmul for all experts' embeddings, as the reference does.
    expert_emb = F.linear(h, A_assigned.reshape(E * r, d)).view(-1, E, r)  # (N, E, r)
    token_emb = F.linear(h, P)  # (N, r)
    return _route(expert_emb, token_emb, top_k)


def vanilla_gate(h: torch.Tensor, W_assigned: torch.Tensor, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FedAMoLE-A's vanilla MoLE gate over the assigned experts: logits ``W_j . h``, then (7)-(9).

    Args:
        h: (N_tok, d) token hidden states.
        W_assigned: (E, d) the router rows of the E assigned domain experts.
        top_k: experts per token; clipped to E.

    Returns:
        ``(gates_full, topk_idx, topk_w)`` as :func:`amole_gate`.
    """
    if W_assigned.dim() != 2 or W_assigned.shape[0] == 0 or W_assigned.shape[1] != h.shape[-1] or top_k < 1:
        raise ValueError(f"vanilla MoLE gate: W must be (E >= 1, d={h.shape[-1]}) and top_k >= 1, got "
                         f"{tuple(W_assigned.shape)}, top_k={top_k}")
    return _select(F.linear(h, W_assigned), top_k)


def _route(
    expert_emb: torch.Tensor, token_emb: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations (6)-(9) from the (N, E, r) expert and (N, r) token embeddings."""
    r = expert_emb.shape[2]
    return _select(torch.einsum("ner,nr->ne", expert_emb, token_emb) / math.sqrt(r), top_k)  # scores (N, E)


def _select(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations (7)-(9) from (N, E) gate scores: full softmax, top-k, weights renormalised over the k."""
    E = scores.shape[1]
    gates_full = scores.softmax(dim=-1)  # (N, E)
    k = min(top_k, E)
    top_p, topk_idx = gates_full.topk(k, dim=-1)  # (N, k)
    topk_w = top_p / top_p.sum(dim=-1, keepdim=True)  # (N, k)
    return gates_full, topk_idx, topk_w


def amole_delta_dense(
    expert_emb: torch.Tensor,
    B: torch.Tensor,
    scaling: float,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
) -> torch.Tensor:
    """Routed sum from precomputed ``A_j x`` of every assigned expert for every token.

    The gate already computed ``A_j h`` for every assigned expert, so the routed sum is one
    (N, E*r) x (E*r, o) matmul with the unselected experts' weights at zero. On CPU this beats
    the grouped path (no gather, no scatter, one large GEMM) for the few experts a client holds.

    Args:
        expert_emb: (N_tok, E, r) ``A_j x``: the gate's embeddings when nothing is dropped,
            else ``A_j`` applied to the dropped-out input.
        B: (E, o, r) stacked B.
        scaling: LoRA scaling ``s``.
        topk_idx: (N_tok, k) selected indices.
        topk_w: (N_tok, k) their weights.

    Returns:
        (N_tok, o) routed update.
    """
    n_tok, E, r = expert_emb.shape
    w_full = expert_emb.new_zeros(n_tok, E).scatter(1, topk_idx, topk_w.to(expert_emb.dtype))
    weighted = (expert_emb * w_full.unsqueeze(-1)).reshape(n_tok, E * r)  # (N, E*r)
    B_cat = B.transpose(1, 2).reshape(E * r, B.shape[1])  # (E*r, o)
    return (weighted @ B_cat.to(weighted.dtype)) * scaling  # (N, o)


def amole_delta(
    h: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scaling: float,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """Return the routed sum ``sum_slot w * s * B_j A_j drop(h)`` for every token.

    Dropout is drawn independently for every (token, slot) pair, as in the reference code where
    each expert applies its own dropout module to its slice of repeated tokens.

    Args:
        h: (N_tok, d) token hidden states.
        A: (E, r, d) stacked A of the assigned domain experts.
        B: (E, o, r) stacked B.
        scaling: LoRA scaling ``s`` (alpha / r), the same for every expert.
        topk_idx: (N_tok, k) selected indices into the stacks.
        topk_w: (N_tok, k) weights of the selected experts.
        dropout_p: LoRA dropout probability on the expert input.
        training: dropout is applied only when True.

    Returns:
        (N_tok, o) routed update.
    """
    n_tok, k = topk_idx.shape
    E, o = A.shape[0], B.shape[1]
    flat_expert = topk_idx.reshape(-1)  # (N*k,)
    order = torch.argsort(flat_expert, stable=True)  # (N*k,) pairs grouped by expert
    token_of_pair = order // k  # (N*k,)
    counts = torch.bincount(flat_expert, minlength=E).tolist()
    x = h.index_select(0, token_of_pair)  # (N*k, d)
    if training and dropout_p > 0.0:
        x = lora_dropout(x, dropout_p)
    pieces = []
    start = 0
    for j, c in enumerate(counts):
        if c:
            xs = x[start : start + c]  # (c, d)
            pieces.append(F.linear(F.linear(xs, A[j]), B[j]))  # (c, o)
            start += c
    y = torch.cat(pieces) if pieces else x.new_zeros(0, o)  # (N*k, o)
    coef = topk_w.reshape(-1).index_select(0, order) * scaling  # (N*k,)
    out = h.new_zeros(n_tok, o, dtype=y.dtype)
    return out.index_add(0, token_of_pair, y * coef.unsqueeze(-1).to(y.dtype))  # (N, o)


def amole_forward(
    h: torch.Tensor,
    base_out: torch.Tensor,
    shared_A: torch.Tensor | None,
    shared_B: torch.Tensor | None,
    A: torch.Tensor,
    B: torch.Tensor,
    P: torch.Tensor,
    scaling: float,
    top_k: int,
    dropout_p: float = 0.0,
    training: bool = False,
    routed_dropout: RoutedDropout = "per_expert",
    router: Router = "amole",
) -> AMoLEOutput:
    """Full AMoLE module output (equation (11)) given the frozen layer's output ``W0 h + b``.

    Without active dropout, or with ``routed_dropout="per_token"``, the routed sum takes the dense
    path; with per-expert dropout, the grouped path. Dropout masks are the only difference.

    Args:
        h: (N_tok, d) or (B, T, d) input of the adapted Linear.
        base_out: (N_tok, o) or (B, T, o) frozen layer output.
        shared_A: (r, d) shared-expert A, or None for the "no shared expert" ablation (FedAMoLE-S).
        shared_B: (o, r) shared-expert B, or None together with ``shared_A``.
        A: (E, r, d) assigned domain experts' A.
        B: (E, o, r) assigned domain experts' B.
        P: (r, d) token projection; with ``router="vanilla"`` the (E, d) router rows of the assigned experts.
        scaling: LoRA scaling ``s`` for the shared and every domain expert.
        top_k: experts per token (clipped to E).
        dropout_p: LoRA dropout on the expert paths only; the gate always sees the clean ``h``.
        training: enables dropout.
        routed_dropout: ``"per_expert"`` (reference): every (token, selected expert) pair draws its
            own mask. ``"per_token"``: one mask per token shared by its routed experts, which lets
            training use the dense path; on CPU mask generation dominates, so this is faster.
        router: ``amole`` (the shape-invariant gate, eqs. (4)-(9)) or ``vanilla`` (FedAMoLE-A's linear router).

    Returns:
        :class:`AMoLEOutput` with the output shaped like ``base_out`` and the flattened gate
        statistics for :func:`load_balance_loss`.
    """
    if (shared_A is None) != (shared_B is None):
        raise ValueError("shared_A and shared_B must be both given or both None")
    d = h.shape[-1]
    hf = h.reshape(-1, d)  # (N, d)
    E, r, _ = A.shape
    dropping = training and dropout_p > 0.0
    if routed_dropout not in ("per_expert", "per_token"):
        raise ValueError(f"routed_dropout must be per_expert or per_token, got {routed_dropout!r}")
    if router not in ("amole", "vanilla"):
        raise ValueError(f"router must be amole or vanilla, got {router!r}")
    vanilla = router == "vanilla"
    if vanilla and P.shape[0] != E:
        raise ValueError(f"a vanilla router needs one row per assigned expert: {tuple(P.shape)} for E={E}")
    if dropping and routed_dropout == "per_expert":
        gates_full, topk_idx, topk_w = vanilla_gate(hf, P, top_k) if vanilla else amole_gate(hf, P, A, top_k)
        delta = amole_delta(
            hf, A, B, scaling, topk_idx, topk_w, dropout_p=dropout_p, training=True
        )  # (N, o)
    else:
        # The gate's expert embeddings A_j h double as the LoRA path's when nothing is dropped.
        if not vanilla:
            _check_gate_inputs(hf, P, A, top_k)
        A_cat = A.reshape(E * r, d)
        expert_emb = F.linear(hf, A_cat).view(-1, E, r)  # (N, E, r)
        gates_full, topk_idx, topk_w = vanilla_gate(hf, P, top_k) if vanilla else \
            _route(expert_emb, F.linear(hf, P), top_k)
        lora_emb = expert_emb
        if dropping:
            lora_emb = F.linear(lora_dropout(hf, dropout_p), A_cat).view(-1, E, r)
        delta = amole_delta_dense(lora_emb, B, scaling, topk_idx, topk_w)  # (N, o)
    if shared_A is not None and shared_B is not None:
        xs = lora_dropout(hf, dropout_p) if dropping else hf
        delta = delta + F.linear(F.linear(xs, shared_A), shared_B) * scaling
    out = base_out + delta.view(base_out.shape).to(base_out.dtype)
    return AMoLEOutput(out=out, gates_full=gates_full, topk_idx=topk_idx, topk_w=topk_w)


def load_balance_loss(
    gates_full: torch.Tensor, topk_idx: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer load-balance loss of one module, ``E * sum_j P_j f_j`` (eqs. (26)-(27)).

    ``P_j`` is the mean full-softmax probability of expert j over the tokens and ``f_j`` the share
    of the k*T top-k selections that went to j. It equals 1 for a perfectly balanced gate and grows
    to E when every token goes to the same experts. Gradients flow through ``P`` only. The paper's
    loss sums this over all AMoLE modules of the model; that sum is the caller's job.

    Args:
        gates_full: (N_tok, E) softmax over the assigned experts.
        topk_idx: (N_tok, k) selections.
        token_mask: optional (N_tok,) bool; False tokens (padding) are left out. The reference
            counts every token of its batch-size-1 sequences, prompt included.

    Returns:
        A scalar tensor.
    """
    if token_mask is not None:
        keep = token_mask.reshape(-1).to(torch.bool)
        gates_full, topk_idx = gates_full[keep], topk_idx[keep]
    n_tok, E = gates_full.shape
    if n_tok == 0:
        return gates_full.sum() * 0.0
    k = topk_idx.shape[1]
    mean_prob = gates_full.mean(dim=0)  # (E,)
    counts = torch.bincount(topk_idx.reshape(-1), minlength=E).to(gates_full.dtype)  # (E,)
    frac = counts / (k * n_tok)  # (E,)
    return E * torch.dot(mean_prob, frac)
