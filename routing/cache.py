"""Per-client caches of local-instance embeddings: a faiss inner-product index over unit vectors.

FedDPA (paper 000 section 4.3) compares a request with S of its client's local instances. We embed the
instances once and keep them in a ``faiss.IndexFlatIP`` over L2-normalised vectors (inner product =
cosine), saved beside the client's adapter as ``embeddings.faiss`` with the raw ``embeddings.npy``, so a
request costs one forward of its own prompt instead of S + 1. faiss is imported lazily; without it the
same search runs as a numpy matrix product. :class:`IndexCache` keeps loaded indexes keyed by
(client, version) and resolves every path inside the named client's own folder.

Each index records how its vectors were pooled (``embeddings.kind.json``: the last token, or the mean
over the prompt's tokens, ``routing.embedding``); an index without the record holds last-token vectors,
the only kind written before it existed. A request pooled otherwise is refused, never compared.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from adapters import AdapterError
from adapters.rundir import check_client_id
from routing.base import Pooling, RoutingError, StoredRoutingError
from routing.calibration import CALIBRATION_FILE, Calibration, Scorer, fingerprint
from routing.embedding import check_pooling

STEM = "embeddings"
KIND_FORMAT = 1


def kind_file(folder: Path, stem: str = STEM) -> Path:
    """``<stem>.kind.json``: how the vectors of ``folder``'s index were pooled."""
    return Path(folder) / f"{stem}.kind.json"


def index_pooling(folder: Path, stem: str = STEM) -> Pooling:
    """The pooling of the index in ``folder`` (``last`` when unrecorded: indexes written before the record).

    Raises:
        RoutingError: the record is unreadable or names an unknown pooling.
    """
    path = kind_file(folder, stem)
    if not path.is_file():
        return "last"
    try:
        data = json.loads(path.read_text())
        return check_pooling(data["embedding"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise RoutingError(f"{path} is not a readable FedDPA index record: {exc}") from exc


def check_index_pooling(folders: Mapping[str, Path], wanted: str, run: object = "RUN_DIR") -> None:
    """Refuse to route with ``wanted`` pooling over clients whose index was pooled otherwise.

    Args:
        folders: client -> its folder (only clients with an index are checked).
        wanted: the pooling requests will be embedded with.
        run: the run directory, named in the error's fix.

    Raises:
        RoutingError: one line naming the clients, what their index holds and the command that rebuilds it.
    """
    wanted = check_pooling(wanted)
    other = {c: index_pooling(f) for c, f in folders.items() if (Path(f) / f"{STEM}.npy").is_file()}
    other = {c: p for c, p in other.items() if p != wanted}
    if other:
        held = sorted(set(other.values()))[0]
        raise RoutingError(
            f"FedDPA embedding {wanted!r} was asked for, but the index of clients {sorted(other)} holds {held!r} "
            f"embeddings; rebuild it with `fedmosaic calibrate {run} --feddpa-embedding {wanted}` "
            f"(or use --feddpa-embedding {held})")


def _faiss() -> ModuleType | None:
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def _client_id(client: str) -> str:
    try:
        return check_client_id(client)
    except (AdapterError, TypeError) as exc:
        raise RoutingError(f"client id {client!r} must be a plain name (letters, digits, '_', '-', '.')") from exc


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


class EmbeddingIndex:
    """Unit-normalised embeddings of one client's local instances, searchable by cosine.

    Attributes:
        raw: (N, H) the vectors as given.
        unit: (N, H) L2-normalised copies (what every cosine uses).
        calibration: the client's calibration of its score (``routing.calibration``), if any.
        pooling: how the vectors were pooled from the final-layer states: ``last`` token or ``mean``.
    """

    def __init__(self, vectors: np.ndarray, use_faiss: bool = True, _index: Any = None,
                 calibration: Calibration | None = None, pooling: str = "last") -> None:
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or vectors.shape[0] == 0 or vectors.shape[1] == 0:
            raise RoutingError(f"an embedding index needs a non-empty (N, H) array, got shape {vectors.shape}")
        if not np.isfinite(vectors).all():
            raise RoutingError("embeddings contain NaN or inf")
        self.raw = np.ascontiguousarray(vectors, dtype=np.float32)
        self.unit = np.ascontiguousarray(_normalise(self.raw))
        self.pooling: Pooling = check_pooling(pooling)
        self.calibration: Calibration | None = None
        self._scorer: Scorer | None = None
        if calibration is not None:
            self.set_calibration(calibration)
        self._faiss: Any = None
        faiss = _faiss() if use_faiss else None
        if faiss is not None:
            self._faiss = _index if _index is not None else faiss.IndexFlatIP(self.dim)
            if _index is None:
                self._faiss.add(self.unit)

    def __len__(self) -> int:
        return int(self.unit.shape[0])

    @property
    def dim(self) -> int:
        """Vector width H."""
        return int(self.unit.shape[1])

    @property
    def uses_faiss(self) -> bool:
        """True when searches run through faiss, False for the numpy fallback."""
        return self._faiss is not None

    def set_calibration(self, calibration: Calibration) -> None:
        """Attach ``calibration``, doing its per-index work once, not per request (the Gaussian's fit, or
        the centred vectors of the cosine statistics).

        Raises:
            RoutingError: the calibration was computed from other vectors (a stale file).
        """
        if calibration.fingerprint != fingerprint(self.raw) or calibration.center.shape != (self.dim,):
            raise RoutingError("the FedDPA calibration does not match this index's vectors (built from another "
                               "index); rebuild it with `fedmosaic calibrate RUN_DIR`")
        self._scorer = calibration.scorer(self.raw)
        self.calibration = calibration

    def calibrated_score(self, query: np.ndarray) -> float:
        """The calibration's score of one raw (H,) state against this index (higher: more typical).

        Raises:
            RoutingError: no calibration attached.
        """
        if self._scorer is None:
            raise RoutingError("this index has no FedDPA calibration")
        return float(self._scorer(np.asarray(query, dtype=np.float32)[None, :])[0])

    def _query(self, query: np.ndarray) -> np.ndarray:
        q = np.atleast_2d(np.asarray(query, dtype=np.float32))
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise RoutingError(f"query must be (H,) or (Q, H) with H={self.dim}, got shape {np.shape(query)}")
        if not np.isfinite(q).all():
            raise RoutingError("query contains NaN or inf")
        return np.ascontiguousarray(_normalise(q))  # (Q, H)

    def search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Return (cosines (Q, k), indices (Q, k)) of the k nearest stored vectors, nearest first.

        ``k`` larger than the index is cut to its size.
        """
        if k < 1:
            raise RoutingError(f"k must be >= 1, got {k}")
        q = self._query(query)
        k = min(k, len(self))
        if self._faiss is not None:
            sims, idx = self._faiss.search(q, k)
            return sims, idx
        sims = q @ self.unit.T  # (Q, N)
        idx = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(sims, idx, axis=1), idx

    def cosines(self, query: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Cosine of ``query`` (H,) with the stored vectors at ``indices``; same shape as ``indices``."""
        return self.unit[indices] @ self._query(query)[0]

    def sample(self, s: int, generator: np.random.Generator) -> np.ndarray:
        """Return the indices (s,) of ``s`` distinct stored vectors drawn uniformly (the paper's estimator).

        ``s`` larger than the index returns every index in random order.
        """
        if s < 1:
            raise RoutingError(f"the sample size S must be >= 1, got {s}")
        return generator.choice(len(self), size=min(s, len(self)), replace=False)

    def save(self, folder: Path, stem: str = STEM) -> None:
        """Write ``<stem>.npy`` (raw vectors), ``<stem>.kind.json``, ``<stem>.faiss`` with faiss, the calibration."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{stem}.npy", self.raw)
        kind_file(folder, stem).write_text(json.dumps({"format": KIND_FORMAT, "embedding": self.pooling}))
        if stem == STEM and self.calibration is not None:
            self.calibration.save(folder)
        elif stem == STEM:  # a calibration left from earlier vectors would no longer match them
            (folder / CALIBRATION_FILE).unlink(missing_ok=True)
        faiss = _faiss() if self._faiss is not None else None
        if faiss is not None:
            faiss.write_index(self._faiss, str(folder / f"{stem}.faiss"))

    @classmethod
    def load(cls, folder: Path, stem: str = STEM, use_faiss: bool = True) -> EmbeddingIndex:
        """Read ``<stem>.npy``, its pooling record, ``<stem>.faiss`` (when present and faiss is importable) and the
        calibration.

        A faiss file that disagrees with the vectors (another size or width: files of two different
        builds) raises rather than answering searches over stale vectors.
        """
        folder = Path(folder)
        path = folder / f"{stem}.npy"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        raw = np.load(path, allow_pickle=False)
        faiss = _faiss() if use_faiss else None
        index_path = folder / f"{stem}.faiss"
        index = None
        if faiss is not None and index_path.is_file():
            index = faiss.read_index(str(index_path))
            if raw.ndim != 2 or index.ntotal != raw.shape[0] or index.d != raw.shape[1]:
                raise RoutingError(
                    f"{index_path} holds {index.ntotal} x {index.d} vectors but {path} has shape {raw.shape}; "
                    "rebuild the index"
                )
        calibration = Calibration.load(folder) if stem == STEM else None
        return cls(raw, use_faiss=use_faiss, _index=index, calibration=calibration,
                   pooling=index_pooling(folder, stem))


class IndexCache:
    """Loaded :class:`EmbeddingIndex` per (client, version), least recently used evicted first.

    The adapter pool bumps a client's version on every reload, so a new version always reads the
    files again; the older versions of that client are dropped at once. Paths are built here from
    the client id alone (``root/<client>/embeddings.*``), so a request for one client can never read
    another client's vectors. Thread-safe.
    """

    def __init__(self, root: Path, capacity: int = 16, use_faiss: bool = True, stem: str = STEM) -> None:
        """Create an empty cache.

        Args:
            root: the folder holding one folder per client (``RUN_DIR/adapters/clients``).
            capacity: indexes kept at most.
            use_faiss: search with faiss when importable.
            stem: file name stem of the saved vectors.
        """
        if capacity < 1:
            raise RoutingError(f"IndexCache capacity must be >= 1, got {capacity}")
        self.root = Path(root)
        self.capacity = capacity
        self.use_faiss = use_faiss
        self.stem = stem
        self._items: OrderedDict[tuple[str, int | str], EmbeddingIndex] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, run_dir: Path, capacity: int = 16, use_faiss: bool = True) -> IndexCache:
        """A cache over the clients of the run directory ``run_dir``."""
        return cls(Path(run_dir) / "adapters" / "clients", capacity=capacity, use_faiss=use_faiss)

    def client_folder(self, client: str) -> Path:
        """The folder of ``client``; raises unless it is a plain name that stays inside ``root``."""
        client = _client_id(client)
        folder = self.root / client
        # a symlinked client folder pointing elsewhere (another client's) is refused as well
        if folder.exists() and folder.resolve() != self.root.resolve() / client:
            raise RoutingError(f"client folder {folder} resolves outside {self.root}")
        for path in (folder / f"{self.stem}.npy", folder / f"{self.stem}.faiss", folder / CALIBRATION_FILE,
                     kind_file(folder, self.stem)):
            if path.exists() and path.resolve().parent != folder.resolve():
                raise RoutingError(f"{path} resolves outside the folder of client {client!r}")
        return folder

    def get(self, client: str, version: int | str = 0) -> EmbeddingIndex:
        """Return the index of ``client`` at ``version``, loading it from the client's folder on a miss.

        Raises:
            RoutingError: a bad client id.
            StoredRoutingError: the client's files are missing, unreadable, malformed or stale (a
                FileNotFoundError under it when the client has no saved embeddings).
        """
        key = (_client_id(client), version)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
        try:
            index = EmbeddingIndex.load(self.client_folder(client), stem=self.stem, use_faiss=self.use_faiss)
        except (OSError, ValueError, RuntimeError) as exc:  # faiss raises RuntimeError on a corrupt file
            raise StoredRoutingError(f"the FedDPA files of client {key[0]!r} cannot be used: {exc}") from exc
        self.put(client, version, index)
        return index

    def put(self, client: str, version: int | str, index: EmbeddingIndex) -> None:
        """Store an index built in memory (e.g. right after embedding a newly loaded adapter's data)."""
        client = _client_id(client)
        with self._lock:
            for old in [k for k in self._items if k[0] == client and k[1] != version]:
                del self._items[old]
            self._items[(client, version)] = index
            self._items.move_to_end((client, version))
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def invalidate(self, client: str) -> None:
        """Drop every cached version of ``client`` (its adapter was unloaded)."""
        client = _client_id(client)
        with self._lock:
            for old in [k for k in self._items if k[0] == client]:
                del self._items[old]

    def keys(self) -> list[tuple[str, int | str]]:
        """Cached (client, version) keys, least recently used first."""
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)
