"""A FedAMoLE run with each client's own model (``adapters/clients/<id>/amole``, paper 002 App. D.1.1):
``<client>`` is served by that model, the aggregated pool stays served as ``amole:<client>``, and runs
without the clients' folders are served as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters import inject
from adapters.amole_io import ASSIGNMENTS, load_amole, read_amole_meta
from adapters.amole_routing import AMoLERouting
from models import LoadedModel, tiny_llama
from serving.access import Binding
from serving.engine import Engine
from serving.engine.request import GenerationRequest, GenerationResult
from serving.engine.sampling import SamplingParams
from serving.errors import AdapterLoadFailed
from serving.pool.pool import AdapterPool
from serving.targets import TargetResolver
from tests.serving.test_amole_serving import PROMPTS, write_amole


def write_own(folder: Path, client: str, seed: int) -> None:
    """A client's own AMoLE folder as ``export=local`` writes it: the whole pool, its assignment alone."""
    assignments = write_amole(folder, seed=seed)
    (folder / ASSIGNMENTS).write_text(json.dumps({client: assignments[client]}))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("own") / "run"
    write_amole(run / "adapters" / "amole", seed=0)
    for i, client in enumerate(("c0", "c1", "c2")):
        write_own(run / "adapters" / "clients" / client / "amole", client, seed=10 + i)
    (run / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny"}))
    return run


def serve(tiny: LoadedModel, run: Path, max_loras: int = 8) -> tuple[Engine, AdapterPool, TargetResolver]:
    adapted = inject(tiny.model)
    engine = Engine(tiny, adapted)
    pool = AdapterPool(adapted, root=run.parent, model_lock=engine.model_lock, max_loras=max_loras)
    pool.load_run(run)
    return engine, pool, TargetResolver("tiny", pool)


def answer(served: tuple[Engine, AdapterPool, TargetResolver], model: str, n: int = 6) -> GenerationResult:
    """``model`` resolved, leased and decoded greedily with each token's log-probability, as the service does."""
    engine, pool, resolver = served
    lease = pool.acquire(resolver.resolve(model).names)
    try:
        sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
        client = model.rpartition(":")[2]
        return engine.generate([GenerationRequest(prompt=PROMPTS[client], sampling=sampling, route=lease.route)])[0]
    finally:
        lease.release()


def direct(folder: Path, client: str, n: int = 6) -> tuple[list[int], list[float]]:
    """The reference: ``folder`` loaded into a fresh model, a full forward per token; tokens and log-probabilities."""
    tiny = tiny_llama()
    adapted = inject(tiny.model)
    assignments, top_k = load_amole(adapted, folder)
    ids = tiny.tokenizer(PROMPTS[client], add_special_tokens=False)["input_ids"]
    out: list[int] = []
    logprobs: list[float] = []
    for _ in range(n):
        routing = AMoLERouting(groups=(assignments[client],), row_group=torch.tensor([0]), top_k=top_k,
                               router=str(read_amole_meta(folder)["router"]))
        with torch.inference_mode(), adapted.context.route_tokens(routing):
            logits = tiny.model(torch.tensor([ids + out])).logits[0, -1].float()
        out.append(int(logits.argmax()))
        logprobs.append(float(torch.log_softmax(logits, -1)[out[-1]]))
    return out, logprobs


def test_a_client_is_served_by_its_own_model_and_the_pool_by_amole_prefix(tiny: LoadedModel, run: Path) -> None:
    served = serve(tiny, run)
    _, pool, resolver = served
    assert resolver.models() == ["tiny", "c0", "c1", "c2", "amole:c0", "amole:c1", "amole:c2"]
    assert resolver.describe("c1")["model"] == "c1:amole" and resolver.describe("amole:c1")["model"] == "amole"
    assert pool.load_run(run).amole_own == ("c0", "c1", "c2")  # a reload registers the same names
    for client in ("c0", "c1"):
        own = answer(served, client)
        want, want_lp = direct(run / "adapters" / "clients" / client / "amole", client)
        assert list(own.token_ids) == want
        assert [t.logprob for t in own.logprobs or ()] == pytest.approx(want_lp, abs=1e-4)
        assert own.route_info["model"] == f"{client}:amole" and own.route_info["client"] == client
        pooled = answer(served, f"amole:{client}")
        want_pool, want_pool_lp = direct(run / "adapters" / "amole", client)
        assert list(pooled.token_ids) == want_pool and pooled.route_info["model"] == "amole"
        assert [t.logprob for t in pooled.logprobs or ()] == pytest.approx(want_pool_lp, abs=1e-4)
        assert (own.token_ids, want_lp) != (pooled.token_ids, want_pool_lp)  # the weights differ, so do the answers
    own_bundle, pool_bundle = pool.amole_bundle("c0:amole"), pool.amole_bundle("amole")
    assert own_bundle is not None and pool_bundle is not None
    assert own_bundle.clients() == ["c0"] and not set(own_bundle.adapter_names) & set(pool_bundle.adapter_names)
    assert all(info.pinned for info in pool.info() if info.kind == "amole")


def test_more_clients_than_free_slots_load_on_use(tiny: LoadedModel, run: Path) -> None:
    """Beyond the free slots the clients' models are evictable and reload from their folders when asked for."""
    served = serve(tiny, run, max_loras=2)
    _, pool, _ = served
    assert [i.pinned for i in pool.info()] == [False, False, False, True]  # c0..c2 own, then the pool
    for client in ("c0", "c1", "c2", "c0"):
        want, _ = direct(run / "adapters" / "clients" / client / "amole", client)
        assert list(answer(served, client).token_ids) == want


def test_a_run_without_own_models_serves_the_pool_as_before(tiny: LoadedModel, tmp_path: Path, run: Path) -> None:
    bare = tmp_path / "run"
    write_amole(bare / "adapters" / "amole", seed=0)
    (bare / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny"}))
    served = serve(tiny, bare)
    assert served[2].models() == ["tiny", "c0", "c1", "c2"] and served[1].load_run(bare).amole_own == ()
    assert list(answer(served, "c0").token_ids) == direct(run / "adapters" / "amole", "c0")[0]


def test_an_own_folder_naming_another_client_is_refused(tiny: LoadedModel, tmp_path: Path) -> None:
    bad = tmp_path / "run"
    write_amole(bad / "adapters" / "amole", seed=0)
    write_own(bad / "adapters" / "clients" / "c0" / "amole", "c1", seed=3)
    (bad / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny"}))
    with pytest.raises(AdapterLoadFailed, match="its own client 'c0'"):
        serve(tiny, bad)


def test_a_key_bound_to_a_client_reaches_the_client_in_the_pool_too() -> None:
    bound = Binding(clients=frozenset({"c0"}))
    assert bound.allows("c0", "tiny") and bound.allows("amole:c0", "tiny")
    assert not bound.allows("amole:c1", "tiny") and not bound.allows("c1", "tiny")
