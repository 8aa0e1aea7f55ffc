"""Federated methods on the tiny model: equivalences, what travels, gradients, resume, failures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from fedmosaic.cli import main
from models import tiny_llama
from training.algorithms import ALGORITHMS
from training.algorithms.feddpa import FedDPATClient
from training.algorithms.fedoa import fedoa_loss
from training.algorithms.terms.cka import linear_cka
from training.data import collate, generate_suite
from training.federation.aggregate import aggregate_results, weighted_average
from training.federation.rounds import RoundConfig
from training.local.runtime import Runtime, preset
from training.protocol import ClientContext, FitIns, FitRes
from training.simulation import SimConfig, run_federated
from training.state import derive_seed

DATA = generate_suite(n_train=6, n_test=2, families=["sorting", "capitals", "date_format"])
TRAIN = preset("tiny")


OPTIONS = {"fedamole": {"num_experts": 3, "max_experts": 3}}


def run(method: str, out: Path, rounds: int = 2, **sim: object) -> RunDir:
    run_federated(method, DATA, tiny_llama(), out, SimConfig(RoundConfig(rounds=rounds), **sim), TRAIN,
                  OPTIONS.get(method), data_spec="generated",
                  data_options={"n_train": 6, "n_test": 2, "families": ["sorting", "capitals", "date_format"]})
    return RunDir(out)


def global_tensors(r: RunDir) -> dict[str, torch.Tensor]:
    return load_file(str(r.global_adapter / "adapter_model.safetensors"))


@pytest.mark.parametrize("method", sorted(ALGORITHMS))
def test_every_method_trains_two_rounds(method: str, tmp_path: Path) -> None:
    r = run(method, tmp_path / method)
    cfg = r.read_config()
    assert cfg["method"] == method and (r.round_dir(1) / "COMPLETE").is_file()
    rows = [json.loads(x) for x in r.metrics.read_text().splitlines()]
    assert all(np.isfinite(x["loss"]) for x in rows if "loss" in x)
    if ALGORITHMS[method].has_local:
        for c in DATA.client_ids:
            assert (r.local_adapter(c) / "adapter_model.safetensors").is_file()
    if method == "fedamole":
        assert (r.amole / "assignments.json").is_file()
    elif method != "local":
        assert r.global_adapter.is_dir()


def test_fedprox_with_mu_zero_equals_fedit(tmp_path: Path) -> None:
    a = global_tensors(run("fedit", tmp_path / "a"))
    run_federated("fedprox", DATA, tiny_llama(), tmp_path / "b", SimConfig(RoundConfig(rounds=2)), TRAIN, {"mu": 0.0})
    b = global_tensors(RunDir(tmp_path / "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    run_federated("fedprox", DATA, tiny_llama(), tmp_path / "c", SimConfig(RoundConfig(rounds=2)), TRAIN, {"mu": 10.0})
    c = global_tensors(RunDir(tmp_path / "c"))
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_aggregation_identity_and_weighting() -> None:
    s = {"w": torch.randn(3, 2)}
    same = aggregate_results([FitRes("a", s, 5), FitRes("b", s, 50)])
    assert same is not None and torch.allclose(same["w"], s["w"])
    t = {"w": torch.zeros(3, 2)}
    by_n = aggregate_results([FitRes("a", s, 1), FitRes("b", t, 3)], "num_examples")
    assert by_n is not None and torch.allclose(by_n["w"], s["w"] / 4)
    assert aggregate_results([]) is None
    with pytest.raises(ValueError, match="different keys"):
        weighted_average([s, {"v": torch.zeros(1)}], [1, 1])


def test_feddpa_t_uploads_only_the_global_and_freezes_it_in_the_local_step() -> None:
    rt = Runtime(tiny_llama(), TRAIN)
    client = DATA.clients[0]
    received = rt.fresh("global", 0)
    ctx = ClientContext(client.client_id, client, rt, {}, seed=0)
    res = FedDPATClient(alpha=0.5).fit(FitIns(round=1, state=received), ctx)
    assert set(res.state) == set(received)  # the global adapter's keys, nothing else
    local = ctx.private["local"]
    assert any(not torch.equal(local[k], res.state[k]) for k in local)  # uploads are not the local adapter
    # the local step: global on beside local, gradient only into local
    rt.set("global", received)
    rt.set("local", local)
    rt.adapted.set_trainable(["local", "global"])  # even if global could learn, the context detaches it
    assert all(p.grad is None for p in rt.adapted.parameters_of(["global", "local"]))
    batch = collate(rt.examples(client)[:2], pad_id=rt.tokenizer.pad_token_id)
    with rt.adapted.context.use(("global", "local"), torch.full((2, 2), 0.5), trainable=("local",)):
        rt.model(**batch).loss.backward()
    assert all(p.grad is None for p in rt.adapted.parameters_of(["global"]))
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in rt.adapted.parameters_of(["local"]))
    rt.adapted.set_trainable([])


def test_fedoa_regulariser_is_zero_when_local_equals_global() -> None:
    rt = Runtime(tiny_llama(), TRAIN)
    state = rt.fresh("global", 3)
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(v.shape, generator=gen) * 0.1 if k.endswith("lora_B") else v) for k, v in state.items()}
    rt.set("global", state)
    rt.set("local", state)
    batch = collate(rt.examples(DATA.clients[1])[:2], pad_id=rt.tokenizer.pad_token_id)
    with torch.no_grad(), rt.adapted.context.use(("local",), torch.ones(2, 1)):
        _, extra = fedoa_loss(0.5, "l2")(rt, batch, ("local",), torch.ones(2, 1))
    assert extra["reg"] == pytest.approx(0.0, abs=1e-5)
    rt.set("local", rt.fresh("local", 9))
    with torch.no_grad(), rt.adapted.context.use(("local",), torch.ones(2, 1)):
        _, extra = fedoa_loss(0.5, "l2")(rt, batch, ("local",), torch.ones(2, 1))
    assert extra["reg"] > 0


def test_cka_equals_hsic_reference_and_is_one_for_identical() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randn(7, 3, generator=gen, dtype=torch.float64)
    n = 7
    H = torch.eye(n, dtype=torch.float64) - torch.ones(n, n, dtype=torch.float64) / n

    def hsic(K: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
        return torch.trace(K @ H @ L @ H) / (n - 1) ** 2

    K, L = x @ x.T, y @ y.T
    ref = hsic(K, L) / torch.sqrt(hsic(K, K) * hsic(L, L))
    assert float(linear_cka(x, y)) == pytest.approx(float(ref), rel=1e-5)
    assert float(linear_cka(x, x)) == pytest.approx(1.0, rel=1e-5)
    assert float(linear_cka(x, 3 * x + 1)) == pytest.approx(1.0, rel=1e-5)  # invariant to scale and shift
    with pytest.raises(ValueError, match="at least 2"):
        linear_cka(x[:1], y[:1])


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    straight = run("feddpa-t", tmp_path / "straight", rounds=3)
    run("feddpa-t", tmp_path / "resumed", rounds=3, failures=frozenset())  # fresh start ...
    partial = tmp_path / "partial"
    run("feddpa-t", partial, rounds=1)
    with pytest.raises(FileExistsError, match="--resume"):
        run("feddpa-t", partial, rounds=1)
    run_federated("feddpa-t", DATA, tiny_llama(), partial, SimConfig(RoundConfig(rounds=3)), TRAIN, resume=True,
                  data_spec="generated",
                  data_options={"n_train": 6, "n_test": 2, "families": ["sorting", "capitals", "date_format"]})
    a, b = global_tensors(straight), global_tensors(RunDir(partial))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for c in DATA.client_ids:
        la = load_file(str(straight.local_adapter(c) / "adapter_model.safetensors"))
        lb = load_file(str(RunDir(partial).local_adapter(c) / "adapter_model.safetensors"))
        assert all(torch.equal(la[k], lb[k]) for k in la)
    with pytest.raises(ValueError, match="cannot resume"):
        run_federated("fedit", DATA, tiny_llama(), partial, SimConfig(RoundConfig(rounds=3)), TRAIN, resume=True,
                      data_spec="generated")


def test_failing_client_is_left_out_and_the_round_completes(tmp_path: Path) -> None:
    r = run("fedit", tmp_path / "f", rounds=2, failures=frozenset({(0, "capitals")}))
    rows = [json.loads(x) for x in r.metrics.read_text().splitlines()]
    failed = [x for x in rows if x.get("status") == "failed"]
    assert len(failed) == 1 and failed[0]["client"] == "capitals" and "simulated failure" in failed[0]["error"]
    agg = [x for x in rows if x.get("aggregate")]
    assert [x["clients"] for x in agg] == [2, 3] and (r.round_dir(1) / "COMPLETE").is_file()
    ok = [x for x in rows if x.get("status") == "ok"]
    assert all(x["bytes_up"] == x["bytes_down"] > 0 for x in ok)  # only the global adapter travels


def test_embeddings_index_beside_each_local_adapter(tmp_path: Path) -> None:
    import faiss

    r = run("feddpa-t", tmp_path / "e", rounds=1)
    for c in DATA.clients:
        vecs = np.load(r.embeddings(c.client_id))
        assert vecs.shape == (len(c.train), 64)
        index = faiss.read_index(str(r.client_dir(c.client_id) / "embeddings.faiss"))
        assert index.ntotal == len(c.train)


def test_seeds_are_stable_across_processes_and_versions() -> None:
    # Pinned values: a resumed run (another process, PYTHONHASHSEED, machine) must draw what the first drew,
    # so the derivation may never change; the values were computed once with the documented rule below.
    assert derive_seed(0, 1, "a") == 1732979770
    assert derive_seed(7, "global-init") == 1041914815
    assert derive_seed(3, 12, "client-x", "local") == 1530342833
    import hashlib

    def rule(*parts: object) -> int:  # the docstring's rule: sha256 of the repr, first 4 bytes, 31 bits
        return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF

    assert all(derive_seed(s, r, c) == rule(s, r, c) for s in (0, 5) for r in range(3) for c in ("a", "b"))
    assert len({derive_seed(0, r, c) for r in range(20) for c in "abcd"}) == 80  # no collisions among labels


def test_train_cli_and_eval_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    assert main(["train", "--method", "feddpa-t", "--data", "generated", "--n-train", "4", "--n-test", "2",
                 "--families", "sorting,capitals", "--rounds", "1", "--out", str(out), "--model", "tiny",
                 "--preset", "tiny", "--option", "alpha=0.3"]) == 0
    assert RunDir(out).read_config()["inference_weight"] == 0.3
    assert main(["eval", str(out), "--limit", "1", "--max-new-tokens", "2"]) == 0
    assert (out / "eval" / "table.md").is_file()
    with pytest.raises(SystemExit):
        main(["train", "--method", "fedit", "--out", str(tmp_path / "x"), "--option", "novalue"])
    with pytest.raises(SystemExit, match="unknown data set 'nope'"):
        main(["train", "--method", "fedit", "--data", "nope", "--out", str(tmp_path / "x"), "--model", "tiny"])
    with pytest.raises(SystemExit, match="too few to hold any out"):
        main(["train", "--method", "feddpa-t", "--data", "generated", "--n-train", "1", "--families", "sorting",
              "--out", str(tmp_path / "x"), "--model", "tiny", "--hold-out", "0.2"])
    assert not (tmp_path / "x").exists()
