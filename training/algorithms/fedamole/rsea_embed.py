"""Client-side RSEA embeddings: token-weighted means of ``P h`` and ``A_j h``, optional DP noise.

FedAMoLE (paper 002, section 4.4, equations (17) and (19); Appendix C.2; docs/methods.md 1.4). After
local training each client runs its embedding set through the model in inference mode and, per AMoLE
module, uploads ``c_i = mean_t P h_t`` (17) and ``e_{j,i} = mean_t A_j h_t`` (19) for every expert
it held. Paper 002 (Appendix C.2) leaves protecting these means to "mature methods such as
differential privacy (Wei et al. 2020)" without a formula; two options are offered: the reference
code's ``--apply_dp`` (Gamma-magnitude noise, rescaled back under the largest clean norm seen,
:func:`add_dp_noise`) and the plain Gaussian mechanism of Wei et al. (:func:`add_gaussian_noise`).
"""

from __future__ import annotations

import numpy as np
import torch


class EmbeddingAccumulator:
    """Token-count weighted running means of ``P h`` (17) and ``A_j h`` (19) for one module.

    Also tracks, per output row, the largest clean batch-mean norm seen, the bound the DP noise
    rescaling uses (the reference mixes batch means and batch sums there; we use means).
    """

    def __init__(self) -> None:
        self._tok_sum: torch.Tensor | None = None  # (r,) float64
        self._exp_sum: torch.Tensor | None = None  # (E, r) float64
        self._count = 0
        self._max_tok_norm = 0.0
        self._max_exp_norms: torch.Tensor | None = None  # (E,)

    @torch.no_grad()
    def add(
        self,
        h_tokens: torch.Tensor,
        P: torch.Tensor,
        A_assigned: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> None:
        """Add a batch of token hidden states.

        Args:
            h_tokens: (..., d) hidden states at the module's input.
            P: (r, d) token projection (FedAMoLE-A: the (N_e, d) vanilla router, whose mean logits it keeps).
            A_assigned: (E, r, d) the client's assigned experts' A, in a fixed order.
            mask: optional bool mask over the leading dims of ``h_tokens``; False = padding.
        """
        E, r, d = A_assigned.shape
        h = h_tokens.reshape(-1, d)
        if mask is not None:
            h = h[mask.reshape(-1).to(torch.bool)]
        n = h.shape[0]
        if n == 0:
            return
        tok = (h @ P.T).double()  # (n, r), or (n, N_e) for a vanilla router
        exp = (h @ A_assigned.reshape(E * r, d).T).double().view(n, E, r)  # (n, E, r)
        if self._tok_sum is None:
            self._tok_sum = tok.new_zeros(tok.shape[1])
            self._exp_sum = exp.new_zeros(E, r)
            self._max_exp_norms = exp.new_zeros(E)
        assert self._exp_sum is not None and self._max_exp_norms is not None
        if self._exp_sum.shape != (E, r):
            old = tuple(self._exp_sum.shape)
            raise ValueError(f"expert stack changed shape: {old} -> {(E, r)}")
        self._tok_sum += tok.sum(0)
        self._exp_sum += exp.sum(0)
        self._count += n
        self._max_tok_norm = max(self._max_tok_norm, float(tok.mean(0).norm()))
        self._max_exp_norms = torch.maximum(self._max_exp_norms, exp.mean(0).norm(dim=-1))

    @property
    def num_tokens(self) -> int:
        """Tokens accumulated so far."""
        return self._count

    @property
    def max_clean_norms(self) -> tuple[float, torch.Tensor]:
        """Largest batch-mean norms seen: token embedding (scalar) and per expert (E,)."""
        if self._max_exp_norms is None:
            raise ValueError("no tokens accumulated")
        return self._max_tok_norm, self._max_exp_norms.float()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(c_i (r,), e_{j,i} (E, r))``, means over every accumulated token, float32."""
        if self._tok_sum is None or self._exp_sum is None or self._count == 0:
            raise ValueError("no tokens accumulated")
        return (self._tok_sum / self._count).float(), (self._exp_sum / self._count).float()


def add_dp_noise(
    emb: torch.Tensor, eta: float, max_norm: float | torch.Tensor, rng: np.random.Generator
) -> torch.Tensor:
    """Noise an uploaded mean embedding as the reference's optional DP (docs/methods.md 1.4).

    Every coordinate gets ``l * v`` with ``l ~ Gamma(shape=dim, rate=eta)`` and ``v ~ U(-1, 1)``;
    each row is then scaled down (never up) so its L2 norm is at most ``max_norm``.

    Args:
        emb: (r,) or (E, r) clean embedding(s).
        eta: the Gamma rate; larger means less noise.
        max_norm: scalar or (E,) bound, the largest clean norm seen for that row.
        rng: numpy generator (seeded by the caller).

    Returns:
        The noised embedding, same shape and dtype.
    """
    dim = emb.shape[-1]
    mag = rng.gamma(shape=dim, scale=1.0 / eta, size=tuple(emb.shape))
    sign = rng.uniform(-1.0, 1.0, size=tuple(emb.shape))
    noisy = emb.double() + torch.from_numpy(mag * sign).to(emb.device)
    bound = torch.as_tensor(max_norm, dtype=torch.float64, device=emb.device)
    if noisy.dim() == 2 and bound.dim() == 1:
        bound = bound.unsqueeze(-1)  # (E, 1)
    norm = noisy.norm(dim=-1, keepdim=noisy.dim() == 2)
    factor = torch.clamp(bound / norm.clamp_min(1e-30), max=1.0)
    return (noisy * factor).to(emb.dtype)


def add_gaussian_noise(emb: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """Gaussian mechanism on an uploaded mean embedding: ``emb + N(0, sigma^2 I)``.

    Args:
        emb: (r,) or (E, r) clean embedding(s).
        sigma: the noise standard deviation per coordinate (>= 0; 0 returns ``emb`` unchanged).
        generator: a CPU generator seeded by the caller (never the global RNG, so training draws stay
            exactly those of a run without noise).

    Returns:
        The noised embedding, same shape and dtype.
    """
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if sigma == 0:
        return emb
    # drawn on the generator's device (the CPU), then moved: the same noise wherever the client ran
    noise = torch.randn(tuple(emb.shape), generator=generator, dtype=torch.float64, device=generator.device) * sigma
    return (emb.double() + noise.to(emb.device)).to(emb.dtype)
