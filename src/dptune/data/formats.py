"""Parsers for the on-disk formats (each raises ``DataError`` on a corrupted file)."""

from __future__ import annotations

import csv
import gzip
import io
import re
import tarfile
from pathlib import Path

import numpy as np

from dptune.data.files import reading
from dptune.errors import DataError

_IDX_DTYPES = {0x08: np.uint8}


def read_npz_split(path: Path, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` uint8 [N,28,28] and ``y`` [N] from a shared-data ``.npz``."""
    with reading(path, dataset), np.load(path, allow_pickle=False) as z:
        x, y = np.asarray(z["x"]), np.asarray(z["y"])
    if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise DataError(
            f"dataset {dataset!r}: {path} holds x{x.shape} / y{y.shape}, expected "
            "x [N,H,W] and y [N]. Replace it with the shared-data copy."
        )
    return x, y


def read_idx_gz(path: Path, dataset: str) -> np.ndarray:
    """An original gzipped IDX file (images: magic 2051, labels: magic 2049)."""
    with reading(path, dataset):
        raw = gzip.decompress(path.read_bytes())
        if len(raw) < 8 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
            raise ValueError("not an unsigned-byte IDX file (bad magic number)")
        ndim = raw[3]
        dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
        start = 4 + 4 * ndim
        size = int(np.prod(dims))
        if len(raw) - start != size:
            raise ValueError(f"IDX header says {dims} = {size} bytes, body has {len(raw) - start}")
        return np.frombuffer(raw, dtype=np.uint8, offset=start).reshape(dims)


ADULT_COLUMNS = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
    "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country",
)  # fmt: skip


def read_adult(path: Path, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows ([N, 14] array of strings) and labels (>50K -> 1) of ``adult.data`` / ``.test``."""
    rows: list[list[str]] = []
    labels: list[int] = []
    with reading(path, dataset):
        text = path.read_text(encoding="ascii")
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("|"):
                continue
            fields = line.replace(" ", "").split(",")  # no value contains a space
            if len(fields) != 15:
                raise ValueError(f"line {lineno} has {len(fields)} fields, expected 15")
            label = fields[14].rstrip(".")
            if label not in (">50K", "<=50K"):
                raise ValueError(f"line {lineno}: unknown label {fields[14]!r}")
            rows.append(fields[:14])
            labels.append(int(label == ">50K"))
    if not rows:
        raise DataError(f"dataset {dataset!r}: {path} holds no rows; replace it.")
    return np.asarray(rows, dtype=str), np.asarray(labels, dtype=np.int64)


_HTML_NUM = re.compile(r"#(\d+);")


def clean_ag_news(text: str) -> str:
    """Undo the CSV's escapes: ``\\`` marks a line break, `` #36;`` is a numeric entity."""
    text = text.replace("\\", " ")
    return _HTML_NUM.sub(lambda m: chr(int(m.group(1))) if int(m.group(1)) < 0x110000 else " ", text)


def read_ag_news(path: Path, dataset: str) -> tuple[list[str], np.ndarray]:
    """Texts (title + ' ' + description, cleaned) and labels 0..3 of an AG News CSV."""
    texts: list[str] = []
    labels: list[int] = []
    with reading(path, dataset), open(path, encoding="utf-8", newline="") as fh:
        for lineno, row in enumerate(csv.reader(fh), 1):
            if len(row) != 3 or row[0] not in ("1", "2", "3", "4"):
                raise ValueError(f"row {lineno} is not (class 1-4, title, description)")
            texts.append(clean_ag_news(row[1] + " " + row[2]))
            labels.append(int(row[0]) - 1)
    if not texts:
        raise DataError(f"dataset {dataset!r}: {path} holds no rows; replace it.")
    return texts, np.asarray(labels, dtype=np.int64)


def read_enron_csv(path: Path, dataset: str) -> tuple[list[str], list[str], np.ndarray]:
    """(file names, texts, labels spam=1) from the shared ``enron1.csv.gz``, by file name."""
    with reading(path, dataset), gzip.open(path, "rt", encoding="utf-8", newline="") as fh:
        recs = []
        for row in csv.DictReader(fh):
            label = {"ham": 0, "spam": 1}[row["label"]]
            if int(row["label_num"]) != label:
                raise ValueError(f"{row['filename']}: label and label_num disagree")
            recs.append((row["filename"], row["text"], label))
    return _enron_sorted(recs, path, dataset)


def read_enron_tar(path: Path, dataset: str) -> tuple[list[str], list[str], np.ndarray]:
    """(file names, texts, labels spam=1) from the AUEB ``enron1.tar.gz`` archive."""
    recs = []
    with reading(path, dataset), tarfile.open(path, "r:gz") as tar:
        for member in tar:
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 3 or parts[-2] not in ("ham", "spam"):
                continue
            fh = tar.extractfile(member)
            if fh is None:
                continue
            text = io.TextIOWrapper(fh, encoding="latin-1", newline="").read()
            recs.append((parts[-1], text, int(parts[-2] == "spam")))
    return _enron_sorted(recs, path, dataset)


def _enron_sorted(
    recs: list[tuple[str, str, int]], path: Path, dataset: str
) -> tuple[list[str], list[str], np.ndarray]:
    if not recs:
        raise DataError(f"dataset {dataset!r}: no messages found in {path}; replace it.")
    recs.sort(key=lambda r: r[0])
    names, texts, labels = zip(*recs, strict=True)
    return list(names), list(texts), np.asarray(labels, dtype=np.int64)


def read_gisette(data: Path, labels: Path, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """Features (int, 5000 columns) and labels (+1 -> 1, -1 -> 0)."""
    with reading(data, dataset):
        x = np.loadtxt(data, dtype=np.float32, ndmin=2)
    with reading(labels, dataset):
        y = np.loadtxt(labels, dtype=np.int64, ndmin=1)
    if x.shape[0] != y.shape[0] or not np.isin(y, (-1, 1)).all():
        raise DataError(
            f"dataset {dataset!r}: {data} ({x.shape[0]} rows) and {labels} ({y.shape[0]} "
            "labels in {-1,1}) do not match; delete both and load again."
        )
    return x, (y > 0).astype(np.int64)
