"""Serving FedAMoLE runs: per-token expert routing in the engine, mixed batches, client isolation,
expert-usage counts, hot reload of a run with versions, and the HTTP API on a trained 1-round run."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from adapters import LoraConfig, inject
from adapters.amole_io import load_amole, read_amole_meta, save_amole
from adapters.amole_layer import add_amole_experts
from adapters.amole_routing import AMoLERouting
from adapters.amole_union import ExpertRecorder
from models import LoadedModel, tiny_llama
from serving.engine import Engine
from serving.engine.request import GenerationRequest, GenerationResult
from serving.engine.sampling import SamplingParams
from serving.errors import AdapterExists, AdapterNotFound, InvalidRequest
from serving.pool import AdapterPool
from serving.settings import ServeSettings
from serving.targets import TargetResolver
from tests.serving.helpers import ready_client, write_adapter

NUM_EXPERTS = 6
PROMPTS = {"c0": "Sort these words", "c1": "The capital of France is", "c2": "twelve plus seven"}


def write_amole(folder: Path, seed: int, router: str = "amole") -> dict[str, dict[str, list[int]]]:
    """An AMoLE folder for the tiny model: random experts and projections, per-layer assignments."""
    adapted = inject(tiny_llama().model)
    add_amole_experts(adapted, NUM_EXPERTS, LoraConfig(r=4, alpha=8.0, dropout=0.0), seed=seed, router=router)
    gen = torch.Generator().manual_seed(100 + seed)
    for layer in adapted.layers.values():
        for adapter in layer.adapters.values():
            with torch.no_grad():
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=gen) * 0.4)
    # Disjoint sets for c0 and c1 in every layer, different per layer; c2 overlaps both.
    assignments = {
        "c0": {p: sorted({i % 3, (i + 1) % 3}) for i, p in enumerate(adapted.layers)},
        "c1": {p: sorted({3 + i % 3, 3 + (i + 2) % 3, 3 + (i + 1) % 3}) for i, p in enumerate(adapted.layers)},
        "c2": {p: [1, 2, 4, 5] for p in adapted.layers},
    }
    save_amole(adapted, folder, NUM_EXPERTS, assignments, top_k=2, router=router)
    return assignments


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("amole")
    write_amole(root / "run" / "adapters" / "amole", seed=0)
    (root / "run" / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny"}))
    write_amole(root / "v2", seed=1)
    write_adapter(tiny_llama(), root / "plain", seed=3)
    return root


@pytest.fixture()
def served(tiny: LoadedModel, root: Path) -> tuple[Engine, AdapterPool, TargetResolver]:
    adapted = inject(tiny.model)
    engine = Engine(tiny, adapted)
    pool = AdapterPool(adapted, root=root, model_lock=engine.model_lock)
    pool.load_run("run")
    pool.load("plain", "plain")
    return engine, pool, TargetResolver("tiny", pool)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def request(served: tuple[Engine, AdapterPool, TargetResolver], model: str, n: int,
            prompt: str | None = None) -> GenerationRequest:
    """Resolve ``model`` and lease it as the HTTP service does (the lease is released at once:
    nothing is reloaded while these tests run)."""
    _, pool, resolver = served
    plan = resolver.resolve(model)
    lease = pool.acquire(plan.names)
    lease.release()
    text = prompt or PROMPTS.get(model, "Convert 5 km")
    if lease.route is not None:  # an AMoLE client: the typed route, no plain adapters
        return GenerationRequest(prompt=text, sampling=greedy(n), route=lease.route)
    return GenerationRequest(prompt=text, sampling=greedy(n), adapter_names=lease.names, adapter_weights=plan.weights)


def direct_greedy(folder: Path, client: str, prompt: str, n: int) -> tuple[list[int], torch.Tensor]:
    """The reference: load_amole into a fresh model, full forward per token under route_amole."""
    tiny = tiny_llama()
    adapted = inject(tiny.model)
    assignments, top_k = load_amole(adapted, folder)
    router = str(read_amole_meta(folder)["router"])
    ids = tiny.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    paths = list(adapted.layers)
    usage = torch.zeros(len(paths), NUM_EXPERTS, dtype=torch.long)
    out: list[int] = []
    for _ in range(n):
        recorder = ExpertRecorder()
        routing = AMoLERouting(groups=(assignments[client],), row_group=torch.tensor([0]), top_k=top_k,
                               recorder=recorder, router=router)
        with torch.inference_mode(), adapted.context.route_tokens(routing):
            logits = tiny.model(torch.tensor([ids + out])).logits[0, -1]
        usage += recorder.counts(paths, NUM_EXPERTS, 1, last_token=True)[0]
        out.append(int(logits.argmax()))
    return out, usage


def usage_of(result: GenerationResult) -> torch.Tensor:
    report = result.route_info["expert_usage"]
    return torch.tensor([report["counts"][p] for p in report["layers"]])


def test_engine_equals_a_direct_route_amole_loop(served, root: Path) -> None:  # noqa: ANN001
    engine = served[0]
    result = engine.generate([request(served, "c0", 10)])[0]
    want, want_usage = direct_greedy(root / "run" / "adapters" / "amole", "c0", PROMPTS["c0"], 10)
    assert list(result.token_ids) == want
    info = result.route_info
    assert info["client"] == "c0" and info["model"] == "amole" and info["version"] == 1 and info["top_k"] == 2
    assert torch.equal(usage_of(result), want_usage)
    base = engine.generate([request(served, "tiny", 10, PROMPTS["c0"])])[0]
    assert base.token_ids != result.token_ids  # the experts matter


def test_a_vanilla_router_run_is_served_with_its_router(tiny: LoadedModel, tmp_path: Path) -> None:
    """FedAMoLE-A (paper 002 s5.5): the folder says ``router: vanilla``; the engine routes a batch of its
    clients with the vanilla routers exactly as a direct loop over the loaded folder does."""
    write_amole(tmp_path / "run" / "adapters" / "amole", seed=2, router="vanilla")
    (tmp_path / "run" / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny"}))
    adapted = inject(tiny.model)
    engine = Engine(tiny, adapted)
    pool = AdapterPool(adapted, root=tmp_path, model_lock=engine.model_lock)
    pool.load_run("run")
    served = (engine, pool, TargetResolver("tiny", pool))
    results = engine.generate([request(served, c, 6) for c in ("c0", "c1")])
    for client, result in zip(("c0", "c1"), results, strict=True):
        want, want_usage = direct_greedy(tmp_path / "run" / "adapters" / "amole", client, PROMPTS[client], 6)
        assert list(result.token_ids) == want and torch.equal(usage_of(result), want_usage)
        assert result.route_info["router"] == "vanilla"


def test_a_server_adapting_more_layers_than_the_run(root: Path) -> None:
    tiny = tiny_llama()
    adapted = inject(tiny.model, ("q_proj", "k_proj", "v_proj"))  # k_proj holds no AMoLE expert
    engine = Engine(tiny, adapted)
    pool = AdapterPool(adapted, root=root, model_lock=engine.model_lock)
    pool.load_run("run")
    result = engine.generate([request((engine, pool, TargetResolver("tiny", pool)), "c1", 6)])[0]
    want, want_usage = direct_greedy(root / "run" / "adapters" / "amole", "c1", PROMPTS["c1"], 6)
    assert list(result.token_ids) == want and torch.equal(usage_of(result), want_usage)


def test_a_mixed_continuous_batch_equals_solo_runs(served) -> None:  # noqa: ANN001
    engine = served[0]
    models = [("c0", 9), ("c1", 6), ("tiny", 7), ("plain", 5), ("c2", 8), ("c0", 4)]
    reqs = [request(served, m, n, prompt=list(PROMPTS.values())[i % 3]) for i, (m, n) in enumerate(models)]
    solo = [engine.generate([r])[0] for r in reqs]
    handles = [engine.submit(r) for r in reqs[:4]]
    engine.step()
    engine.step()
    handles += [engine.submit(r) for r in reqs[4:]]  # join mid-flight, beside AMoLE, LoRA and base rows
    while engine.step():
        pass
    for alone, handle in zip(solo, handles, strict=True):
        together = handle.result()
        assert together.token_ids == alone.token_ids
        if "expert_usage" in alone.route_info:
            assert torch.equal(usage_of(together), usage_of(alone))
        else:
            assert "expert_usage" not in together.route_info


class Sealed(Mapping[str, tuple[int, ...]]):
    """An assignment nobody may read."""

    def __getitem__(self, key: str) -> tuple[int, ...]:
        raise AssertionError(f"another client's assignment was read ({key})")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("another client's assignment was iterated")

    def __len__(self) -> int:
        raise AssertionError("another client's assignment was sized")


def test_a_request_reads_only_its_own_clients_assignment(served) -> None:  # noqa: ANN001
    engine, pool, _ = served
    first = engine.generate([request(served, "c0", 6)])[0]
    bundle = pool.amole_bundle("amole")
    assert bundle is not None
    own = bundle.assignments["c0"]
    for other in ("c1", "c2"):
        bundle.assignments[other] = Sealed()
    again = engine.generate([request(served, "c0", 6), request(served, "plain", 6)])[0]
    assert again.token_ids == first.token_ids
    usage = usage_of(again)
    for i, path in enumerate(bundle.layers):  # every choice lies within c0's own experts
        outside = [j for j in range(NUM_EXPERTS) if j not in own[path]]
        assert usage[i, outside].sum() == 0 and usage[i].sum() == 2 * again.completion_tokens


def test_usage_counts_per_layer_in_a_shared_batch(served) -> None:  # noqa: ANN001
    engine, pool, _ = served
    bundle = pool.amole_bundle("amole")
    r0, r1 = engine.generate([request(served, "c0", 7), request(served, "c1", 5)])
    for result, client in ((r0, "c0"), (r1, "c1")):
        report = result.route_info["expert_usage"]
        assert report["tokens"] == result.completion_tokens and report["experts"] == list(range(NUM_EXPERTS))
        assert report["assigned"] == {p: list(bundle.assignments[client][p]) for p in bundle.layers}
        usage = usage_of(result)
        assert (usage.sum(dim=1) == 2 * result.completion_tokens).all()  # top-2 of every generated token
        for i, path in enumerate(bundle.layers):
            assert all(usage[i, j] == 0 for j in range(NUM_EXPERTS) if j not in bundle.assignments[client][path])


def test_request_errors(served) -> None:  # noqa: ANN001
    engine, pool, resolver = served
    with pytest.raises(AdapterNotFound):  # a route is a typed field, never an encoded adapter name
        engine.submit(GenerationRequest(prompt="x", adapter_names=("amole@1/c0",), adapter_weights=(1.0,)))
    route = pool.acquire(["c0"])
    route.release()
    with pytest.raises(ValueError, match="routes every token itself"):
        GenerationRequest(prompt="x", route=route.route, adapter_names=("plain@1",), adapter_weights=(1.0,))
    with pytest.raises(InvalidRequest, match="request it alone"):
        pool.acquire(["c0", "plain"])
    with pytest.raises(InvalidRequest, match="AMoLE clients"):
        resolver.resolve("tiny", [("c0", 1.0), ("plain", 0.5)])
    with pytest.raises(AdapterExists, match="clashes"):
        pool.load("again", "v2")  # its clients are already served by "amole"
    with pytest.raises(AdapterNotFound, match="unload that model"):
        pool.unload("c0")
    assert resolver.models() == ["tiny", "plain", "c0", "c1", "c2"] and "global" not in resolver.models()
    assert resolver.resolve("c1").mode == "amole" and resolver.resolve("c1").client == "c1"


def test_hot_reload_keeps_in_flight_requests_on_their_version(served, root: Path) -> None:  # noqa: ANN001
    engine, pool, resolver = served
    v1 = engine.generate([request(served, "c0", 8)])[0]
    lease = pool.acquire(["c0"])
    handle = engine.submit(GenerationRequest(prompt=PROMPTS["c0"], sampling=greedy(8), route=lease.route))
    handle.add_done_callback(lease.release)
    engine.step()
    engine.step()
    info = pool.load("amole", "v2", replace=True)
    assert info.version == 2 and info.kind == "amole" and info.clients == ("c0", "c1", "c2")
    prefixes = {n.split("/")[0] for n in engine.adapted.configs if "/" in n}
    assert prefixes == {"amole@1", "amole@2"}  # the old experts stay while the request decodes
    while engine.step():
        pass
    assert handle.result().token_ids == v1.token_ids and handle.result().route_info["version"] == 1
    assert {n.split("/")[0] for n in engine.adapted.configs if "/" in n} == {"amole@2"}
    v2 = engine.generate([request(served, "c0", 8)])[0]
    want, _ = direct_greedy(root / "v2", "c0", PROMPTS["c0"], 8)
    assert list(v2.token_ids) == want and v2.route_info["version"] == 2 and v2.token_ids != v1.token_ids
    pool.unload("amole", force=True)
    assert resolver.models() == ["tiny", "plain"] and not [n for n in engine.adapted.configs if "/" in n]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.data import generate_suite
    from training.federation.rounds import RoundConfig
    from training.local.runtime import preset
    from training.simulation import SimConfig, run_federated

    out = tmp_path_factory.mktemp("trained") / "run"
    run_federated("fedamole", generate_suite(n_train=6, n_test=2, families=["sorting", "capitals"]), tiny_llama(),
                  out, SimConfig(RoundConfig(rounds=1)), preset("tiny"), {"num_experts": 4}, data_spec="generated",
                  model_name="tiny")
    return out


def test_api_serves_a_trained_fedamole_run(trained_run: Path) -> None:
    settings = ServeSettings(model="tiny", run_dir=trained_run, allow_runtime_lora=True)
    with ready_client(settings) as client:
        cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
        # export=local: each client's own model serves its name, the aggregated pool amole:<client>
        assert list(cards) == ["tiny", "capitals", "sorting", "amole:sorting", "amole:capitals"]
        assert cards["sorting"]["fedmosaic"] == {"kind": "amole", "model": "sorting:amole", "version": 1,
                                                 "loaded": True}
        assert cards["amole:sorting"]["fedmosaic"] == {"kind": "amole", "model": "amole", "version": 1, "loaded": True}
        chat = {"model": "sorting", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Sort these words alphabetically: pear, apple"}]}
        body = client.post("/v1/chat/completions", json=chat).json()
        ext = body["fedmosaic"]
        assert ext["mode"] == "amole" and ext["weights"] == {"sorting": 1.0}
        assert ext["info"]["client"] == "sorting" and ext["info"]["num_experts"] == 4
        assert ext["info"]["model"] == "sorting:amole"
        pooled = client.post("/v1/chat/completions", json={**chat, "model": "amole:sorting"}).json()
        assert pooled["fedmosaic"]["info"]["model"] == "amole" and pooled["fedmosaic"]["info"]["client"] == "sorting"
        usage = ext["info"]["expert_usage"]
        assert usage["tokens"] == body["usage"]["completion_tokens"]
        assert len(usage["layers"]) == 4 and all(sum(c) == 2 * usage["tokens"] for c in usage["counts"].values())
        stream = client.post("/v1/chat/completions", json={**chat, "stream": True}).text
        events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
        assert events[-1]["fedmosaic"]["info"]["expert_usage"]["counts"] == usage["counts"]
        assert client.post("/v1/chat/completions", json={**chat, "model": "global"}).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "amole"}).status_code == 409  # pinned
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "amole", "force": True}).status_code == 200
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["tiny", "capitals", "sorting"]
        taken = client.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": str(trained_run)})
        assert taken.status_code == 400 and taken.json()["error"]["code"] == "name_reserved"  # the run's clients
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "amole", "lora_path": str(trained_run)})
        assert loaded.status_code == 200 and "version 2" in loaded.text  # restored under the names it served
        again = client.post("/v1/chat/completions", json={**chat, "model": "amole:sorting"}).json()
        assert again["choices"][0]["message"] == pooled["choices"][0]["message"]
        assert again["fedmosaic"]["info"]["version"] == 2
        own = str(trained_run / "adapters" / "clients" / "sorting" / "amole")
        for name in ("other", "capitals:amole"):  # the client's name is taken; the run's entry name is reserved
            refused = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": own})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "name_reserved"
        gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "sorting:amole", "force": True})
        back = client.post("/v1/load_lora_adapter", json={"lora_name": "sorting:amole", "lora_path": own})
        assert gone.status_code == 200 and back.status_code == 200  # the run's own folder restores it
        restored = client.post("/v1/chat/completions", json=chat).json()
        assert restored["choices"][0]["message"] == body["choices"][0]["message"]
        assert restored["fedmosaic"]["info"]["version"] == 2
        assert restored["fedmosaic"]["info"]["model"] == "sorting:amole"
