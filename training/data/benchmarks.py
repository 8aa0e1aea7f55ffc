"""The benchmark data sets: where they come from, their SHA-256 sums, where they live, and what a folder is.

FedDPA datasets 1 and 2 (paper 000) are the ``data/`` folder of GitHub ``Lydia-yang/FedDPA``, the Dolly
split that of ``raow02/federated-llm-peft``, each at a pinned commit. :data:`BENCHMARKS` stores each file's
SHA-256; ``fedmosaic data fetch`` (:mod:`training.data.fetch`) checks them and writes a ``manifest.json``
beside the files. A folder is the benchmark its manifest names, or, without one (a copy made by hand), the
benchmark whose every file it holds with the same sums (:func:`identify`): a benchmark's defaults
(FedDPA-T's alpha 0.3 on dataset 2) then follow the content, whatever the folder is called.

Benchmarks are looked up in ``FEDMOSAIC_DATA_DIR`` first, then in the user's data cache
(``$XDG_CACHE_HOME/fedmosaic/data``, ``~/.cache/fedmosaic/data`` by default), where fetch puts them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark data set and its pinned public source.

    Attributes:
        name: the ``--data`` name.
        folder: where it lives under a data folder (``feddpa/dataset1``).
        repo: the GitHub ``owner/name`` holding it.
        commit: the pinned commit.
        path: its folder inside that repository.
        licence: what its terms allow (from the data's provenance notes).
        sums: relative path -> SHA-256 of every file.
    """

    name: str
    folder: str
    repo: str
    commit: str
    path: str
    licence: str
    sums: dict[str, str]

    @property
    def url(self) -> str:
        """The repository's tarball at the pinned commit (GitHub's codeload service)."""
        return f"https://codeload.github.com/{self.repo}/tar.gz/{self.commit}"

    @property
    def browse_url(self) -> str:
        """The folder on GitHub at the pinned commit (where to download the files by hand)."""
        return f"https://github.com/{self.repo}/tree/{self.commit}/{self.path}"

    def raw_url(self, relpath: str) -> str:
        """One file's raw download at the pinned commit."""
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}/{relpath}"


def _training(*sums: str) -> dict[str, str]:
    return {f"8/local_training_{i}.json": s for i, s in enumerate(sums)}


_FEDDPA = ("Lydia-yang/FedDPA", "cf638c11ecf931b2a3be841d3062912b855f3a8d")
_FEDDPA_TERMS = ("the FedDPA repository has no licence; the Flan-derived tasks keep their own terms (some NC, "
                 "Gigaword under LDC's): research use only, do not redistribute")
BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("feddpa1", "feddpa/dataset1", *_FEDDPA, "data/dataset1", _FEDDPA_TERMS, {**_training(
        "38e550b0b9b346010d2642558916c5d0807ba0e765d6fe333b6e3e2464398090",
        "84241186db1c80522af18278102434e3820918f014333be51d3acf684515f0d7",
        "7335a428ee82d4b2147a9b5b71ea47515d5c8547e69e4412be73b3c64c53bcae",
        "fc76202d614776a9bc6b5875a0dd81983f8f81a020d113930807ab288e5c3940",
        "492884e9aa04a2536bdd96753b1dc895bb0cc8fe3cfa7feae7d9ecc05ed8df22",
        "4c1c300412a437434ab8ef62a01b030c9cbd392c3fad4d420fe5ebf8b385b03d",
        "3287eb663d3fb1b4eb0b55c4694faef4438fb7949ae430906e4556017b797f1e",
        "935953f65868f4d263aca17fee68683376bb410403000ee24a260c42bdb51e44"),
        "flan_test_200_selected_nstrict_1.jsonl": "bb1edaafe2eadd2720885aa64113d172f589623477a1ba242e7f6cdeebd9fb8c"}),
    Benchmark("feddpa2", "feddpa/dataset2", *_FEDDPA, "data/dataset2", _FEDDPA_TERMS, {**_training(
        "4e2d34c02a374c035b75dff2d24fa7ea0493369db7ffbe15938473575d3ba8e3",
        "67055b0995740016a304db5393b433fe87c402f33ee4fccde4f70e24a8b25106",
        "0e8bda822f93c46492fe3267715c607c4bf3bcffa53e6bdefaba979f6cbf843a",
        "51e91ace4039363990ceef7d3fb54bab1779197d3d48935db72f9cf30fb610f5",
        "5a2b9303906e0be4ae78b69ddcb2858fa8af3ad9887f114e00451a459d55b7e8",
        "c9ce5c471a66d40f3863febc7a5237bff42edb7ea233c34860816f652930ea37",
        "a4add4b14506aaca6277212ff31c448ebe938216ec900c99f87ead6b9e2f13ef",
        "cf422b5623dac784ac1e3d69396a55472b00304c18e7fd524bee82463abce58d"),
        "flan_test_200_selected_nstrict_1.jsonl": "84cd7d24d9c2ead486fec121f7b7c306c2fc14607456f2771aa93e82653e9303"}),
    Benchmark("dolly", "dolly_fed8/dataset1", "raow02/federated-llm-peft", "2d604a2f6d215e5f8ffd1e24bccab57603419e36",
              "data/dataset1", "databricks-dolly-15k: CC BY-SA 3.0 (attribution, share-alike)", {**_training(
        "00d3b7f5ec56443bb3aab49a15498197b056e926bed867931b6af3728fdab562",
        "a1a85a8288fd0f333afa08fdda49ddaf5024f5aaf933fe91967f0dedc02d0619",
        "afd8044814bcfab53c05d6d854a5bfa971640bd2cf6a6b0d67bbac882d024b74",
        "363952f1ea5f7f8d44e085de2d0b7279deb46bb90198c4e5f3f3d14b0b1403d2",
        "a1a3fa3fd70a067610111c46f5b2ba8bac1c7cc52eac316158da158f1dd8ef28",
        "88c4669f3faedaa9324412b009c31d5d5c0b5914178136eca2519753c49ead35",
        "5cbd3ae985748166bfdd69019efbbacda6f4ae9f734c51c2b3e1d5a346b8fefa",
        "80b19c3bca0ce7b7b5549586c2e4e63ead78fc2fcdfcaacd86fdf39a8390c5d4"),
        "dolly_test_200.jsonl": "8de09a848283687c8b2654abb70344f86a40e8097039711843b83c992920bafd"}),
)}


def data_dir() -> Path | None:
    """The benchmark data folder ``FEDMOSAIC_DATA_DIR`` names, or None when it is not set.

    Read when asked (not at import), so a test can set the variable and see it.
    """
    env = os.environ.get("FEDMOSAIC_DATA_DIR")
    return Path(env).expanduser() if env else None


def cache_data_dir() -> Path:
    """The user's data cache, where ``fedmosaic data fetch`` writes: ``$XDG_CACHE_HOME/fedmosaic/data``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "fedmosaic" / "data"


def benchmark_roots(name: str) -> list[Path]:
    """Where benchmark ``name`` is looked for, in order: ``FEDMOSAIC_DATA_DIR``, then the data cache."""
    folder = BENCHMARKS[name].folder
    env = data_dir()
    return [*([env / folder] if env is not None else []), cache_data_dir() / folder]


def sha256(path: Path) -> str:
    """A file's SHA-256 (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def identify(folder: str | Path) -> str | None:
    """The benchmark ``folder`` holds: its manifest's, else the one whose every file it has with equal sums.

    Returns None for any other folder (your own data).
    """
    root = Path(folder).expanduser().resolve()
    if not root.is_dir():
        return None
    stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*")) if p.is_file())
    return _identify(root, stamp)


@functools.lru_cache(maxsize=64)
def _identify(root: Path, stamp: tuple[tuple[str, int, int], ...]) -> str | None:
    """:func:`identify`, cached on the folder's file names, times and sizes (the sums are read once)."""
    manifest = root / MANIFEST
    if manifest.is_file():
        try:
            name = json.loads(manifest.read_text()).get("benchmark")
        except (ValueError, AttributeError):
            name = None
        if name in BENCHMARKS:
            return str(name)
    for bench in BENCHMARKS.values():
        if all((root / rel).is_file() and sha256(root / rel) == digest for rel, digest in bench.sums.items()):
            return bench.name
    return None


def data_key(spec: str | None) -> str | None:
    """The name a data spec's per-data-set defaults are keyed on: a benchmark's name, however it was given.

    ``feddpa2`` and a folder holding dataset 2's files (by manifest or content) both give ``feddpa2``; any
    other spec is returned as it is.
    """
    if spec is None or spec in BENCHMARKS:
        return spec
    return identify(spec) or spec
