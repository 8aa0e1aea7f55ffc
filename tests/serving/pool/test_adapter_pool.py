"""AdapterPool as explicit step sequences: LRU order, pinning, versions, run dirs, path confinement."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapters import inject
from models import LoadedModel
from serving.engine import Engine
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from serving.errors import AdapterExists, AdapterLoadFailed, AdapterNotFound, NoFreeSlot, PathNotAllowed
from serving.pool import AdapterPool
from tests.serving.helpers import write_adapter, write_feddpa_run


@pytest.fixture()
def folders(tiny: LoadedModel, tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    for i, name in enumerate(("a", "b", "c", "d")):
        write_adapter(tiny, root / name, seed=i)
    return root


def loaded(pool: AdapterPool) -> set[str]:
    return {i.name for i in pool.info() if i.loaded}


def test_lru_eviction_order_and_reload_on_use(tiny: LoadedModel, folders: Path) -> None:
    pool = AdapterPool(inject(tiny.model), root=folders, max_loras=2)
    pool.load("a", "a")
    pool.load("b", "b")
    pool.acquire(["a"]).release()  # a is now more recent than b
    pool.load("c", "c")  # evicts b, the least recently used
    assert loaded(pool) == {"a", "c"}
    assert set(pool.names()) == {"a", "b", "c"}  # b stays registered
    lease = pool.acquire(["b"])  # reloads b (new version), evicting a
    assert loaded(pool) == {"b", "c"}
    assert lease.names == ("b@2",)
    assert sorted(pool.adapted.adapter_names) == ["b@2", "c@1"]
    lease.release()


def test_pinned_and_leased_are_never_evicted(tiny: LoadedModel, folders: Path) -> None:
    pool = AdapterPool(inject(tiny.model), root=folders, max_loras=2)
    pool.load("a", "a", pinned=True)
    pool.load("b", "b")
    lease = pool.acquire(["b"])
    with pytest.raises(NoFreeSlot, match="pinned or in-use"):
        pool.load("c", "c")
    assert loaded(pool) == {"a", "b"} and "c" not in pool
    lease.release()
    pool.load("c", "c")  # b is free now
    assert loaded(pool) == {"a", "c"}


def test_reload_bumps_version_and_in_flight_request_keeps_old(tiny: LoadedModel, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    write_adapter(tiny, root / "v1", seed=1)
    write_adapter(tiny, root / "v2", seed=2)
    adapted = inject(tiny.model)
    engine = Engine(tiny, adapted)
    pool = AdapterPool(adapted, root=root, max_loras=4, model_lock=engine.model_lock)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(name: str) -> tuple[int, ...]:
        lease = pool.acquire([name])
        try:
            return engine.generate([GenerationRequest(prompt="Sort these words", sampling=params,
                                                      adapter_names=lease.names, adapter_weights=(1.0,))])[0].token_ids
        finally:
            lease.release()

    pool.load("c", "v2")
    v2_tokens = run("c")
    pool.unload("c")
    pool.load("c", "v1")
    v1_tokens = run("c")
    assert v1_tokens != v2_tokens

    lease = pool.acquire(["c"])
    assert lease.names == ("c@2",)
    handle = engine.submit(GenerationRequest(prompt="Sort these words", sampling=params,
                                             adapter_names=lease.names, adapter_weights=(1.0,)))
    handle.add_done_callback(lease.release)
    engine.step()
    engine.step()
    with pytest.raises(AdapterExists):
        pool.load("c", "v2")
    info = pool.load("c", "v2", replace=True)
    assert info.version == 3
    assert set(adapted.adapter_names) == {"c@2", "c@3"}  # v1 stays while the request holds it
    while engine.step():
        pass
    assert handle.result().token_ids == v1_tokens
    assert adapted.adapter_names == ["c@3"]  # released, then deleted
    assert run("c") == v2_tokens


def test_path_confinement(tiny: LoadedModel, folders: Path, tmp_path: Path) -> None:
    outside = write_adapter(tiny, tmp_path / "outside", seed=9)
    pool = AdapterPool(inject(tiny.model), root=folders, max_loras=2)
    with pytest.raises(PathNotAllowed, match="outside the adapter root"):
        pool.load("x", "../outside")
    with pytest.raises(PathNotAllowed):
        pool.load("x", str(outside))
    os.symlink(outside, folders / "link")
    with pytest.raises(PathNotAllowed):
        pool.load("x", "link")
    with pytest.raises(AdapterLoadFailed, match="does not exist"):
        pool.load("x", "missing")
    with pytest.raises(AdapterLoadFailed, match="invalid adapter name"):
        pool.load("a@1", "a")
    with pytest.raises(AdapterNotFound):
        pool.acquire(["nope"])
    with pytest.raises(AdapterNotFound):
        pool.unload("nope")
    assert pool.names() == []


def test_load_run_dir(tiny: LoadedModel, tmp_path: Path) -> None:
    run = write_feddpa_run(tmp_path / "run", ("0", "1"), tiny, inference_weight=0.5)
    (run / "adapters" / "clients" / "0" / "embeddings.npy").write_bytes(b"")
    pool = AdapterPool(inject(tiny.model), root=tmp_path, max_loras=4)
    info = pool.load_run("run")
    assert info.method == "feddpa-t" and info.inference_weight == 0.5 and info.global_name == "global"
    assert pool.names() == ["global", "0:local", "1:local"]
    assert pool.info("global")[0].pinned
    assert info.clients["0"].embeddings_npy is not None and info.clients["1"].embeddings_npy is None
    assert info.clients["1"].local == "1:local"


def test_load_run_registers_clients_beyond_the_free_slots(tiny: LoadedModel, tmp_path: Path) -> None:
    """A run with more clients than slots: the first ones load, the rest load on first use (1,000-client runs)."""
    write_feddpa_run(tmp_path / "run", [str(i) for i in range(5)], tiny, inference_weight=None)
    pool = AdapterPool(inject(tiny.model), root=tmp_path, max_loras=3)
    info = pool.load_run("run")
    assert sorted(info.clients) == ["0", "1", "2", "3", "4"]
    assert pool.names() == ["global", "0:local", "1:local", "2:local", "3:local", "4:local"]
    assert loaded(pool) == {"global", "0:local", "1:local"}
    assert [(i.version, i.loaded) for i in pool.info()][3:] == [(0, False)] * 3  # registered, never loaded
    assert len(pool.adapted.adapter_names) == 3
    lease = pool.acquire(["global", "4:local"])  # loads on first use, evicting the least recently used
    assert lease.names == ("global@1", "4:local@1")
    assert loaded(pool) == {"global", "1:local", "4:local"} and len(pool.adapted.adapter_names) == 3
    lease.release()


def test_register_checks_files_now_and_the_weights_on_first_use(tiny: LoadedModel, folders: Path) -> None:
    pool = AdapterPool(inject(tiny.model), root=folders, max_loras=2)
    pool.load("a", "a")
    (folders / "empty").mkdir()
    with pytest.raises(AdapterLoadFailed, match="no adapter_config.json or adapter_model.safetensors"):
        pool.register("e", "empty")
    with pytest.raises(PathNotAllowed):
        pool.register("x", "../elsewhere")
    with pytest.raises(AdapterLoadFailed, match="invalid adapter name"):
        pool.register("bad/name", "b")
    (folders / "torn").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folders / "torn" / name).write_bytes((folders / "b" / name).read_bytes()[:40])
    assert pool.register("t", "torn").loaded is False
    with pytest.raises(AdapterExists):
        pool.register("t", "b")
    with pytest.raises(AdapterLoadFailed):
        pool.acquire(["t"])  # validated when first leased; nothing half-loaded
    assert "t" in pool and loaded(pool) == {"a"} and pool.adapted.adapter_names == ["a@1"]
    assert pool.register("t", "b", replace=True).version == 0
    lease = pool.acquire(["t", "a"])
    assert lease.names == ("t@1", "a@1")
    lease.release()
