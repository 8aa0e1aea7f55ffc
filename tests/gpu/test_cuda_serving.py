"""On a CUDA GPU (``make test-gpu``): runs trained on one device are served and evaluated on the other.

FedDPA-T and FedAMoLE runs of the tiny model are trained on the CPU and on ``cuda:0``, then served in
float32 through :func:`serving.stack.build_stack` + :meth:`~serving.stack.ServingStack.run` (the engine)
on the other device, and on both for the routed weights. A greedy token from one device is checked
against the CPU model's logits for the same prefix and adapters: it must be an argmax up to a near-tie
(1e-3), since float32 rounding may legitimately flip a tie. FedDPA's instance-wise weight ``a`` must agree
across devices within 1e-4 (``knn`` over all S >= N cached instances, so no random draw). Beam search
and ``fedmosaic eval --device cuda`` run the same runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters import AdaptedModel, inject, load_adapter
from adapters.amole_io import load_amole
from adapters.amole_routing import AMoLERouting
from fedmosaic.cli import main
from models import load_base_model, tiny_llama
from routing.feddpa_options import FedDPAOptions
from serving.beam import GenerationConfig, generate_target
from serving.engine.sampling import SamplingParams
from serving.stack import Job, JobOutcome, StackConfig, build_stack
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.local.runtime import preset
from training.simulation import SimConfig, run_federated

pytestmark = pytest.mark.cuda

FAMILIES = ["sorting", "capitals"]
PROMPTS = ["### Instruction:\nSort these words: pear, apple\n\n### Response:\n",
           "### Instruction:\nWhat is the capital of Peru?\n\n### Response:\n", "hello"]
OPTIONS = {"feddpa-t": {}, "fedamole": {"num_experts": 2, "expert_choices": 2}}  # each client holds both experts


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(method, training device) -> run directory."""
    data = generate_suite(n_train=4, n_test=1, families=FAMILIES)
    out = {}
    for method, options in OPTIONS.items():
        for device in ("cpu", "cuda"):
            folder = tmp_path_factory.mktemp("runs") / f"{method}-{device}"
            run_federated(method, data, load_base_model("tiny", device=device), folder,
                          SimConfig(RoundConfig(rounds=2)), preset("tiny", max_steps=2), options, data_spec="generated",
                          model_name="tiny")
            out[(method, device)] = folder
    return out


def _serve(run: Path, device: str) -> list[JobOutcome]:
    config = StackConfig(model="tiny", dtype="float32", device=device, run_dir=run, feddpa=FedDPAOptions(mode="knn"))
    stack = build_stack(config)
    assert stack.loaded.device.type == device
    targets = [t for t in ("sorting", "capitals", "global", "sorting:local", "amole:sorting") if t in stack.models()]
    jobs = [Job(target=t, prompt=p, sampling=SamplingParams(max_tokens=6, temperature=0.0)) for t in targets
            for p in PROMPTS]
    outcomes = list(stack.run(jobs))
    for o in outcomes:
        assert o.error is None and o.result is not None and o.result.finish_reason in ("stop", "length"), o
    return outcomes


Reference = tuple[AdaptedModel, object, dict]


def _amole_reference(folder: Path, client: str) -> Reference:
    loaded = tiny_llama()
    adapted = inject(loaded.model)
    assignments, top_k = load_amole(adapted, folder)
    return adapted, loaded.tokenizer, {"assignment": assignments[client], "top_k": top_k}


def _reference(run: Path) -> dict[str, Reference]:
    """Served target -> the run's adapters for it in a float32 CPU model (the judge of every greedy token).

    A FedAMoLE client is served by its own model (``adapters/clients/<id>/amole``, the default export) and
    ``amole:<client>`` by its route in the aggregated pool (``adapters/amole``).
    """
    if (run / "adapters" / "amole").is_dir():
        refs = {f"amole:{c}": _amole_reference(run / "adapters" / "amole", c) for c in FAMILIES}
        for c in FAMILIES:
            own = run / "adapters" / "clients" / c / "amole"
            refs[c] = _amole_reference(own, c) if own.is_dir() else refs[f"amole:{c}"]
        return refs
    loaded = tiny_llama()
    adapted = inject(loaded.model)
    load_adapter(adapted, run / "adapters" / "global", "global", check_base=False)
    for client in FAMILIES:
        load_adapter(adapted, run / "adapters" / "clients" / client / "local", f"{client}:local", check_base=False)
    return dict.fromkeys(("global", "sorting:local", *FAMILIES), (adapted, loaded.tokenizer, {}))


def _assert_cpu_argmax(references: dict[str, Reference], outcome: JobOutcome) -> None:
    adapted, tokenizer, amole = references[outcome.job.target]
    assert outcome.result is not None and outcome.job.prompt is not None
    prompt = list(tokenizer(outcome.job.prompt, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    tokens = list(outcome.result.token_ids)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        if amole:
            routing = AMoLERouting(groups=(amole["assignment"],), row_group=torch.zeros(1, dtype=torch.long),
                                   top_k=amole["top_k"])
            with adapted.context.route_tokens(routing):
                logits = adapted.model(input_ids=ids).logits[0]
        else:
            weights = outcome.weights()
            with adapted.context.use(tuple(weights), [list(weights.values())] if weights else torch.zeros(1, 0)):
                logits = adapted.model(input_ids=ids).logits[0]
    for j, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + j]
        gap = float(row.max() - row[token])
        assert gap <= 1e-3, f"{outcome.job.target!r} token {j}: the CPU prefers another token by {gap:.2e}"


@pytest.mark.parametrize("method", sorted(OPTIONS))
@pytest.mark.parametrize(("trained", "served"), [("cpu", "cuda"), ("cuda", "cpu")])
def test_a_run_trained_on_one_device_is_served_on_the_other(runs: dict, method: str, trained: str,
                                                            served: str) -> None:
    run = runs[(method, trained)]
    reference = _reference(run)
    outcomes = _serve(run, served)
    if method == "fedamole":  # each client's own model and its route in the aggregated pool
        assert {"sorting", "capitals", "amole:sorting"} <= {o.job.target for o in outcomes}
    for outcome in outcomes:
        _assert_cpu_argmax(reference, outcome)
    if method == "feddpa-t":  # the routed weight does not depend on where the request is embedded
        other = _serve(run, trained)
        for a, b in zip(outcomes, other, strict=True):
            wa, wb = a.weights(), b.weights()
            assert wa.keys() == wb.keys() and all(abs(wa[k] - wb[k]) < 1e-4 for k in wa), (wa, wb)
        routed = [o for o in outcomes if o.job.target in FAMILIES]
        assert routed and all(o.result and o.result.route_info.get("source") == "instance" for o in routed)


def test_beam_search_serves_a_cpu_trained_run_on_cuda(runs: dict) -> None:
    run = runs[("feddpa-t", "cpu")]
    knn = FedDPAOptions(mode="knn")
    gpu = build_stack(StackConfig(model="tiny", dtype="float32", device="cuda", run_dir=run, feddpa=knn))
    cpu = build_stack(StackConfig(model="tiny", dtype="float32", device="cpu", run_dir=run, feddpa=knn))
    config = GenerationConfig(max_new_tokens=4, num_beams=2)
    for target in ("sorting", "global"):
        a, b = generate_target(gpu, target, PROMPTS, config), generate_target(cpu, target, PROMPTS, config)
        for x, y in zip(a, b, strict=True):
            assert x.weights.keys() == y.weights.keys()
            assert all(abs(x.weights[k] - y.weights[k]) < 1e-4 for k in x.weights)
            assert isinstance(x.text, str)


def test_fedmosaic_eval_device_cuda_evaluates_a_cpu_trained_run(runs: dict, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs[("feddpa-t", "cpu")], run)
    assert main(["eval", str(run), "--device", "cuda", "--limit", "1", "--max-new-tokens", "3",
                 "--dtype", "float32", "--feddpa-mode", "knn"]) == 0
    results = json.loads((run / "eval" / "results.json").read_text())
    assert set(results["targets"]) >= {*FAMILIES, "global", "base"}
