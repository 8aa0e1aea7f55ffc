"""Per-client caches of local-instance embeddings: a faiss inner-product index over unit vectors.

FedDPA (paper 000 section 4.3) compares a request with S of its client's local instances. We embed the
instances once and keep them in a ``faiss.IndexFlatIP`` over L2-normalised vectors (inner product =
cosine), saved beside the client's adapter as ``embeddings.faiss`` with the raw ``embeddings.npy``.
faiss is imported lazily; without it the same search runs as a numpy matrix product.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


class EmbeddingIndex:
    """Unit-normalised embeddings of one client's local instances, searchable by cosine."""

    def __init__(self, vectors: np.ndarray, use_faiss: bool = True) -> None:
        if vectors.ndim != 2 or vectors.shape[0] == 0:
            raise ValueError(f"an embedding index needs a non-empty (N, H) array, got shape {vectors.shape}")
        if not np.isfinite(vectors).all():
            raise ValueError("embeddings contain NaN or inf")
        self.raw = np.asarray(vectors, dtype=np.float32)
        self.unit = _normalise(self.raw)
        self._faiss = None
        if use_faiss:
            try:
                import faiss
            except ImportError:
                faiss = None
            if faiss is not None:
                self._faiss = faiss.IndexFlatIP(self.unit.shape[1])
                self._faiss.add(self.unit)

    def __len__(self) -> int:
        return int(self.unit.shape[0])

    @property
    def dim(self) -> int:
        return int(self.unit.shape[1])

    def search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Return (cosines (Q, k), indices (Q, k)) of the k nearest stored vectors."""
        q = _normalise(np.atleast_2d(query))
        k = min(k, len(self))
        if self._faiss is not None:
            sims, idx = self._faiss.search(q, k)
            return sims, idx
        sims = q @ self.unit.T  # (Q, N)
        idx = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(sims, idx, axis=1), idx

    def cosines(self, query: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Cosine of ``query`` (H,) with the stored vectors at ``indices``."""
        return self.unit[indices] @ _normalise(np.atleast_2d(query))[0]

    def save(self, folder: Path, stem: str = "embeddings") -> None:
        """Write ``<stem>.npy`` (raw vectors) and, with faiss, ``<stem>.faiss``."""
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{stem}.npy", self.raw)
        if self._faiss is not None:
            import faiss

            faiss.write_index(self._faiss, str(folder / f"{stem}.faiss"))

    @classmethod
    def load(cls, folder: Path, stem: str = "embeddings", use_faiss: bool = True) -> EmbeddingIndex:
        """Read the raw vectors back (the faiss index is rebuilt from them: exact and fast for flat IP)."""
        path = folder / f"{stem}.npy"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        return cls(np.load(path), use_faiss=use_faiss)
