"""``fedmosaic data fetch NAME``: download a benchmark at its pinned commit, check every file's SHA-256, unpack.

The source is the repository tarball of :attr:`Benchmark.url` (any URL ``urllib`` opens, ``file://`` too, or
a local tarball's path); only the benchmark's own files are taken from it, each checked against the sums
stored in :data:`training.data.benchmarks.BENCHMARKS` before anything is written. The files land in
``<data cache>/<folder>`` with a ``manifest.json`` naming the benchmark, its source and the sums, so that
``--data NAME`` finds them with no environment variable. Without network the error says where to put the
files by hand.
"""

from __future__ import annotations

import datetime
import json
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from training.data.benchmarks import BENCHMARKS, MANIFEST, Benchmark, cache_data_dir, sha256
from training.data.records import DataError


def fetch(name: str, url: str | None = None, dest: Path | None = None, force: bool = False) -> Path:
    """Download benchmark ``name`` into ``dest`` (default: the user's data cache) and return its folder.

    Args:
        name: ``feddpa1``, ``feddpa2`` or ``dolly``.
        url: where to download the repository tarball from (default: the pinned commit on GitHub); a
            ``file://`` URL or a path of a tarball downloaded by hand works too.
        dest: the data folder to write into (the benchmark lands in ``dest/<its folder>``).
        force: fetch again over a complete copy.

    Raises:
        DataError: an unknown name, a download that fails (the message says where to put the files by
            hand), a tarball without the benchmark's files, or a file whose SHA-256 differs (nothing written).
    """
    if name not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; fetch one of {', '.join(BENCHMARKS)}")
    bench = BENCHMARKS[name]
    root = Path(dest).expanduser() if dest is not None else cache_data_dir()
    target = root / bench.folder
    if not force and (target / MANIFEST).is_file() and _complete(target, bench):
        return target
    source = url or bench.url
    if "://" not in source:
        source = Path(source).expanduser().resolve().as_uri()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        tarball = Path(tmp) / "source.tar.gz"
        try:
            with urllib.request.urlopen(source, timeout=60) as response, open(tarball, "wb") as out:  # noqa: S310
                shutil.copyfileobj(response, out)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise DataError(_by_hand(bench, source, target, exc)) from exc
        staged = Path(tmp) / "files"
        _unpack(bench, tarball, staged, source)
        (staged / MANIFEST).write_text(json.dumps({
            "benchmark": bench.name, "source": f"https://github.com/{bench.repo}", "commit": bench.commit,
            "path": bench.path, "url": source, "licence": bench.licence, "sha256": bench.sums,
            "fetched": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }, indent=2, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged.rename(target)
    return target


def _complete(folder: Path, bench: Benchmark) -> bool:
    return all((folder / rel).is_file() and sha256(folder / rel) == s for rel, s in bench.sums.items())


def _unpack(bench: Benchmark, tarball: Path, staged: Path, source: str) -> None:
    """Write the benchmark's files from ``tarball`` into ``staged``, each checked against its stored sum."""
    prefix = bench.path.strip("/") + "/"
    found: dict[str, Path] = {}
    try:
        with tarfile.open(tarball, "r:*") as tar:
            for member in tar:
                # GitHub's tarball holds <repo>-<commit>/<path>; a hand-made one may hold <path> itself
                names = [member.name.removeprefix("./"), member.name.removeprefix("./").partition("/")[2]]
                rel = next((n[len(prefix):] for n in names if n.startswith(prefix)), None)
                if rel not in bench.sums or not member.isfile():
                    continue
                handle = tar.extractfile(member)
                if handle is None:
                    continue
                out = staged / rel  # rel is one of the stored names: never a path outside staged
                out.parent.mkdir(parents=True, exist_ok=True)
                with handle, open(out, "wb") as fh:
                    shutil.copyfileobj(handle, fh)
                got = sha256(out)
                if got != bench.sums[rel]:
                    raise DataError(f"{source}: {bench.path}/{rel} has SHA-256 {got}, expected {bench.sums[rel]} "
                                    f"(stored for {bench.repo}@{bench.commit[:12]}): the download is corrupt or "
                                    "not the pinned commit; nothing was written")
                found[rel] = out
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(f"{source} is not a readable tarball: {exc}") from exc
    missing = sorted(set(bench.sums) - set(found))
    if missing:
        raise DataError(f"{source} lacks {len(missing)} of {bench.name}'s files under {bench.path}/ "
                        f"(first: {missing[0]}); nothing was written")


def _by_hand(bench: Benchmark, source: str, target: Path, exc: Exception) -> str:
    """The error of a failed download: what failed, and how to put the files in place without network."""
    reason = getattr(exc, "reason", exc)
    files = ", ".join(sorted(bench.sums)[:2]) + f" ... ({len(bench.sums)} files)"
    return (f"cannot download {source}: {reason}. Offline? Fetch the files by hand: download {bench.browse_url} "
            f"(or the tarball {bench.url}) on a machine with network, then either run `fedmosaic data fetch "
            f"{bench.name} --url PATH_TO_TARBALL`, or copy the folder's files ({files}) into {target}/ "
            f"(or set FEDMOSAIC_DATA_DIR to a folder holding {bench.folder}/); --data {bench.name} finds them there")
