"""The demo's rendering of synthetic responses: AMoLE expert-usage heatmaps, FedDPA route text, model lists."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.patches import Rectangle

from demos import render
from demos.client import ApiClient, ApiError, ModelEntry
from demos.handlers import Handlers, message_text
from demos.heatmap import find_expert_usage, short_layer, totals, usage_figure

LAYERS = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.q_proj"]
REPORT = {  # the shape serving.engine.amole.usage_report writes
    "tokens": 7, "top_k": 2, "experts": [0, 1, 2, 3], "layers": LAYERS,
    "counts": {LAYERS[2]: [0, 7, 7, 0], LAYERS[0]: [7, 0, 7, 0], LAYERS[1]: [3, 4, 0, 7]},
    "assigned": {LAYERS[0]: [0, 2], LAYERS[1]: [0, 1, 3], LAYERS[2]: [1, 2]},
}
FEDDPA = {"mode": "feddpa", "weights": {"global": 0.7, "sorting:local": 0.3},
          "info": {"mode": "random", "S": 5, "S_requested": 5, "mean_similarity": 0.6, "lambda": 0.5, "a": 0.3,
                   "variant": "paper", "source": "instance"}}


@pytest.mark.parametrize("key", ["experts", "expert_usage", "anything"])
def test_usage_report_is_found_under_any_key_in_layer_order(key: str) -> None:
    ext = {"mode": "amole", "weights": {}, "info": {"client": "3", "top_k": 2, key: REPORT}}
    usage = find_expert_usage(ext)
    assert usage is not None and usage.layers == tuple(LAYERS) and usage.experts == ("0", "1", "2", "3")
    assert usage.counts[0] == (7.0, 0.0, 7.0, 0.0) and usage.counts[2] == (0.0, 7.0, 7.0, 0.0)
    assert usage.tokens == 7 and usage.assigned is not None and usage.assigned[LAYERS[1]] == ("0", "1", "3")
    assert list(totals(usage)) == [10.0, 11.0, 14.0, 7.0]


def test_nested_layer_expert_counts_and_absent_usage() -> None:
    nested = {"model.layers.1.mlp": {"e2": 1, "e10": 4}, "model.layers.0.mlp": {"e1": 2}}
    ext = {"mode": "amole", "info": {"experts": nested}}
    usage = find_expert_usage(ext)
    assert usage is not None and usage.experts == ("e1", "e2", "e10")  # natural order
    assert usage.layers == ("model.layers.1.mlp", "model.layers.0.mlp")
    assert usage.counts == ((0.0, 1.0, 4.0), (2.0, 0.0, 0.0))
    assert find_expert_usage(FEDDPA) is None and find_expert_usage(None) is None
    assert find_expert_usage({"mode": "adapter", "weights": {"global": 1.0}, "info": {}}) is None
    assert find_expert_usage({"info": {"experts": [0, 1], "counts": {"l": ["x"]}}}) is None


def test_heatmap_draws_counts_and_outlines_assigned_experts() -> None:
    usage = find_expert_usage({"info": REPORT})
    assert usage is not None
    fig = usage_figure(usage)
    ax = fig.axes[0]
    data = np.asarray(ax.images[0].get_array())
    np.testing.assert_array_equal(data, np.array([REPORT["counts"][x] for x in LAYERS], dtype=float))
    outlined = sorted((round(p.get_x() + 0.5), round(p.get_y() + 0.5)) for p in ax.patches if isinstance(p, Rectangle))
    assert outlined == sorted((e, i) for i, x in enumerate(LAYERS) for e in REPORT["assigned"][x])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0.q_proj", "0.v_proj", "1.q_proj"]
    assert "7 tokens" in ax.get_title()
    assert short_layer("lm_head") == "lm_head"
    assert Handlers.heatmap({"info": REPORT})["visible"] is True
    assert Handlers.heatmap(FEDDPA)["visible"] is False


def test_route_text_explains_how_the_weight_was_obtained() -> None:
    text = render.route_markdown(FEDDPA)
    assert "**FedDPA weight a = 0.300**" in text and "instance-wise" in text and "**S = 5**" in text
    assert "**0.600**" in text and "λ = 0.500" in text and "variant = paper" in text
    assert render.route_summary(FEDDPA) == "FedDPA a = 0.300 · instance-wise (S = 5, mean similarity 0.600, λ = 0.500)"
    fixed = {"mode": "feddpa", "weights": {"global": 0.5, "0:local": 0.5}, "info": {"alpha": 0.5, "source": "fixed"}}
    assert "**fixed**" in render.route_markdown(fixed) and render.local_weight(fixed) == 0.5
    assert render.route_summary(fixed) == "FedDPA a = 0.500 · fixed (the run's α)"
    assert "the base model alone" in render.route_markdown({"mode": "base", "weights": {}, "info": {}})
    mixture = {"mode": "mixture", "weights": {"a": 0.25, "b": 0.75}}
    assert render.route_summary(mixture) == "mixture: a × 0.250, b × 0.750"
    assert "no `fedmosaic`" in render.route_markdown(None) and render.local_weight(None) is None


def test_route_text_of_a_calibrated_decision() -> None:
    """Issue 19's calibrated weighting: the centred score between the background and own levels."""
    ext = {"mode": "feddpa", "weights": {"global": 0.8, "sorting:local": 0.2},
           "info": {"weighting": "calibrated", "statistic": "centroid", "score": 0.42, "own": 0.6,
                    "background": 0.3, "lambda": 0.5, "a": 0.2, "variant": "paper"}}
    text = render.route_markdown(ext)
    assert "**FedDPA weight a = 0.200**" in text and "instance-wise, calibrated" in text
    assert "**0.420**" in text and "background level 0.300" in text and "own level 0.600" in text
    assert "score =" not in text and "variant = paper" in text  # the levels are explained, not repeated
    assert render.route_summary(ext) == ("FedDPA a = 0.200 · instance-wise, calibrated (score 0.420, own 0.600, "
                                         "background 0.300)")


def test_route_text_when_the_server_withholds_the_details() -> None:
    """The server's privacy default: the mode and the weights, no similarity (admin keys see it)."""
    private = {"mode": "feddpa", "weights": {"global": 0.7, "sorting:local": 0.3},
               "info": {"source": "instance", "mode": "random"}}
    text = render.route_markdown(private)
    assert "**FedDPA weight a = 0.300**" in text and "instance-wise" in text and "withholds" in text
    assert "None" not in text and render.route_summary(private) == "FedDPA a = 0.300 · instance-wise"
    fixed = {"mode": "feddpa", "weights": {"global": 0.5, "0:local": 0.5}, "info": {"source": "fixed", "mode": "fixed"}}
    assert "**fixed** — the run's inference weight for every prompt" in render.route_markdown(fixed)


def test_amole_route_text() -> None:
    ext = {"mode": "amole", "weights": {"c3": 1.0},
           "info": {"client": "c3", "top_k": 2, "shared_expert": True, "num_experts": 4, "expert_usage": REPORT}}
    text = render.route_markdown(ext)
    assert "**per token**" in text and "top-2" in text and "shared expert" in text and "7 generated tokens" in text
    assert "client = c3" in text and "num_experts = 4" in text and "counts" not in text
    assert render.route_summary(ext) == "AMoLE · top-2 of the client's experts per token, 7 tokens"
    assert find_expert_usage(ext) is not None


def test_model_lists() -> None:
    models = [ModelEntry("tiny", "base"), ModelEntry("global", "adapter", root="/r/g"),
              ModelEntry("7:local", "adapter"), ModelEntry("7", "feddpa"), ModelEntry("8", "feddpa"),
              ModelEntry("c3", "amole")]
    assert [v for _, v in render.model_choices(models)] == ["7", "8", "c3", "global", "7:local", "tiny"]
    assert render.model_choices(models)[2][0] == "c3 — client (AMoLE experts)"
    assert render.clients(models) == ["7"]  # client 8 has no local adapter loaded
    assert render.loaded_adapters(models) == ["global", "7:local"]
    assert render.adapter_rows(models)[1] == ["global", "one adapter", "", "", "", "/r/g"]


def test_error_envelopes_and_message_parts() -> None:
    body = {"error": {"message": "no", "type": "NotFoundError", "code": "model_not_found"}}
    error = ApiError.from_envelope(body, 404)
    assert (error.status, error.code, error.kind, str(error)) == (404, "model_not_found", "NotFoundError",
                                                                  "HTTP 404, model_not_found: no")
    assert str(ApiError.from_envelope("<html>bad gateway</html>", 502)) == "HTTP 502: <html>bad gateway</html>"
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    assert message_text("x") == "x" and message_text(None) == ""


def test_unreachable_api_is_reported_not_swallowed() -> None:
    h = Handlers(ApiClient("http://127.0.0.1:9", timeout=2))
    status, target, *_ = h.refresh()
    assert status.startswith("⚠️ API error — API: cannot reach http://127.0.0.1:9/v1/models")
    assert target["choices"] == [] and target["value"] is None
    *_, (history, box, route, _, _) = list(h.chat("Hi", [], None, "instruction (as trained)", 4, 0.0))
    assert history == [] and box == "Hi" and "pick a model" in route
    *_, (history, _, route, _, _) = list(h.chat("Hi", [], "0", "instruction (as trained)", 4, 0.0))
    assert "connection to http://127.0.0.1:9/v1/completions failed" in history[-1]["content"] and "⚠️" in route
    tables, plots, note = h.evaluation()
    assert (tables, plots) == ("", []) and note.startswith("⚠️ API error")
    assert h.compare(None, "x", "instruction (as trained)", 4, 0.0)[0] == "⚠️ pick a client"
