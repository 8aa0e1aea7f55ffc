"""min-p sampling (vLLM's ``min_p``) against a naive loop over probabilities, and where it sits in the pipeline."""

from __future__ import annotations

import torch

from serving.engine.sampling import SamplingParams, make_generator, min_p_filter, sample_batch


def naive_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        probs = torch.softmax(logits[b].double(), dim=-1).tolist()
        top = max(probs)
        for v, p in enumerate(probs):
            if p < min_p[b] * top:
                out[b, v] = float("-inf")
    return out


def test_min_p_filter_matches_a_naive_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen) * 3
    min_p = [0.0, 0.01, 0.1, 0.5, 1.0]
    out = min_p_filter(logits, torch.tensor(min_p))
    want = naive_min_p(logits, min_p)
    # the threshold is compared in log space: a token within float rounding of it may fall either way
    close = (torch.softmax(logits.double(), -1) / torch.softmax(logits.double(), -1).max(-1, keepdim=True).values
             - torch.tensor(min_p, dtype=torch.double).unsqueeze(1)).abs() < 1e-6
    assert torch.equal(torch.isinf(out) | close, torch.isinf(want) | close)
    assert torch.equal(out[~torch.isinf(out)], logits[~torch.isinf(out)])  # kept logits unchanged
    assert (~torch.isinf(out[4])).sum() == 1 and not torch.isinf(out[0]).any()


def test_min_p_applies_after_the_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0]])
    # at temperature 1, p1 / p0 = e^-1 = 0.37 survives min_p 0.3; at temperature 0.5 it is e^-2 = 0.14 and does not
    for temperature, allowed in ((1.0, {0, 1}), (0.5, {0})):
        params = SamplingParams(temperature=temperature, min_p=0.3, seed=0)
        drawn = {sample_batch(logits, [params], [make_generator(SamplingParams(temperature=temperature, seed=s))])[0]
                 for s in range(200)}
        assert drawn == allowed, temperature


def test_min_p_is_checked() -> None:
    for bad in (-0.1, 1.1, float("nan")):
        try:
            SamplingParams(min_p=bad)
        except ValueError as exc:
            assert "min_p" in str(exc)
        else:
            raise AssertionError(bad)
