"""Your own CSV file as a ``Dataset`` through a public schema: a function of the header and of your
declarations only, never fitted on the rows (docs/your_data.md; the label set: docs/privacy.md)."""

from __future__ import annotations

import csv
import logging
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dptune.data.dataset import Dataset, features_tensor, labels_tensor
from dptune.errors import OWNER, ConfigError, DataError

log = logging.getLogger("dptune")
CSV_KEYS = ("csv", "label", "test", "schema", "numeric", "categories", "labels")


def _read(path: Path) -> tuple[list[str], list[list[str]], list[int]]:
    """(header, rows of strings, each row's line in the file); a missing, empty or ragged file is one ``DataError``."""
    table, lines = [], []
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            reader = csv.reader(fh)
            for row in reader:
                if any(v.strip() for v in row):  # blank lines skipped, still counted (found in review)
                    table.append([v.strip() for v in row])
                    lines.append(reader.line_num)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"cannot read the CSV file {path}: {exc}. Fix: pass a readable UTF-8 CSV file.") from exc
    if len(table) < 2:
        raise DataError(f"{path} holds no data rows. Fix: a header line, then one line per example.")
    twice = sorted({c for c in table[0] if table[0].count(c) > 1})
    if twice:  # both would be read as one declared column (found in review)
        raise DataError(f"{path}: the header names {twice} more than once. Fix: give every column its own name.")
    width = len(table[0])
    if (bad := next((i for i, row in enumerate(table) if len(row) != width), None)) is not None:
        raise DataError(
            f"{path}, line {lines[bad]}: {len(table[bad])} fields, the header has {width}. Fix: give every line "
            f"{width} fields (quote a field that holds a comma)."
        )
    return table[0], table[1:], lines[1:]


def _float(value: str | float) -> float:
    try:
        return float(value)
    except ValueError:
        return float("nan")


def _column(path: Path, col: str, values: list[str], lines: list[int], decl: Mapping[str, Any]) -> np.ndarray:
    """One feature column encoded by the declarations ``decl`` ([N, 1] numeric or [N, k] one-hot). A bad
    cell is quoted so that its owner can find it; the message is about one example."""
    if col in decl["categories"]:
        cats = [str(c) for c in decl["categories"][col]]
        bad = next((v for v in values if v not in cats), None)
        if bad is not None:
            raise DataError(
                f"{path}: column {col!r} holds {bad!r}{OWNER}, not one of its declared categories. Fix: add it."
            )
        return np.asarray([[v == c for c in cats] for v in values], dtype=np.float64)
    x = np.asarray([_float(v) for v in values])
    # Without bounds the cell is kept as it is, in float32: beyond float32's range it would be inf (found in review).
    top = np.inf if col in decl["numeric"] else float(np.finfo(np.float32).max)
    bad_i = next((i for i, v in enumerate(x) if not abs(v) <= top), None)
    if bad_i is not None:
        msg = f"{path}, line {lines[bad_i]}: column {col!r} holds {values[bad_i]!r}{OWNER}, not a finite number (float32). Fix: correct"
        raise DataError(
            f"{msg} it, or declare the column's categories (categories.{col} = [...], --schema in the CLI)."
        )
    if col in decl["numeric"]:
        lo, hi = (_float(b) for b in decl["numeric"][col])
        x = (np.clip(x, lo, hi) - lo) / (hi - lo)
    return x[:, None]


def _declarations(header: list[str], label: str, decl: dict[str, Any], path: Path) -> dict[str, Any]:
    if label not in header:
        raise DataError(f"{path} has no label column {label!r}; its columns are {header}. Fix: --label COLUMN.")
    decl = {**decl, "numeric": dict(decl.get("numeric") or {}), "categories": dict(decl.get("categories") or {})}
    for col in [*decl["numeric"], *decl["categories"]]:
        if col not in header or col == label:
            raise DataError(f"the schema declares column {col!r}, not a feature column of {path}. Fix: the schema.")
    for col, b in decl["numeric"].items():
        pair = [_float(v) if isinstance(v, int | float | str) else np.nan for v in b] if isinstance(b, Sequence) else []
        # finite, ordered, and a finite width: an infinite bound made NaN or zero features (found in review)
        if len(pair) != 2 or not pair[0] < pair[1] or not np.isfinite(pair[1] - pair[0]) or col in decl["categories"]:
            raise DataError(
                f"numeric.{col} = {b!r}. Fix: declare finite public bounds [lo, hi], lo < hi (or categories)."
            )
    return decl


def _classes(cells: list[tuple[Path, str, int]], decl: Mapping[str, Any]) -> list[str]:
    """The declared labels, else the sorted distinct cells (as numbers if all are; review: "", "1.0" beside "1")."""
    if empty := next(((p, n) for p, v, n in cells if not v), None):
        raise DataError(f"{empty[0]}, line {empty[1]}: the label cell is empty{OWNER}. Fix: label every example.")
    if decl.get("labels"):
        return [str(v) for v in decl["labels"]]
    values = sorted({v for _, v, _ in cells})
    if not all(np.isfinite(_float(v)) for v in values):
        return values
    if len({_float(v) for v in values}) < len(values):
        raise DataError(
            f"the label column spells one number in two ways{OWNER}, e.g. {values[:4]}. Fix: write each label "
            "one way, or declare the labels (schema: labels = [...])."
        )
    return sorted(values, key=_float)


def describe_schema(header: list[str], label: str, decl: Mapping[str, Any], classes: list[str]) -> str:
    """The schema in words, one column a line (what ``load_csv`` logs and keeps in ``Dataset.notes``)."""
    how = {c: "numeric, as it is (no declared bounds: no scaling)" for c in header}
    how.update({c: f"numeric, clipped to the declared {list(b)}, scaled to [0, 1]" for c, b in decl["numeric"].items()})
    how.update({c: f"one-hot over the declared categories {list(v)}" for c, v in decl["categories"].items()})
    source = (
        "declared"
        if decl.get("labels")
        else "the sorted distinct values of the files, not declared: not differentially private: for the data owner only"
    )
    how[label] = f"label: {len(classes)} classes {classes} ({source})"
    head = "CSV schema (public: from the header and your declarations, not fitted on the rows):"
    return "\n  ".join([head, *(f"{c}: {how[c]}" for c in header)])


def load_csv(csv: str, *, label: str, test: str | None = None, schema: str | None = None, **declared: Any) -> Dataset:
    """The file ``csv`` (and ``test``, same header; else an empty test split) as a classification ``Dataset``;
    ``declared`` ``numeric``/``categories``/``labels`` over the TOML ``schema``'s. A bad file is a ``DataError``."""
    try:
        decl = {**(tomllib.loads(Path(schema).read_text(encoding="utf-8")) if schema else {}), **declared}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise DataError(f"cannot read the schema file {schema}: {exc}. Fix: pass a TOML file.") from exc
    if unknown := sorted(set(decl) - {"numeric", "categories", "labels"}):
        raise ConfigError(f"unknown schema declaration(s) {unknown}. Fix: declare numeric, categories or labels.")
    header, rows, lines = _read(Path(csv))
    decl = _declarations(header, label, decl, Path(csv))
    if header == [label]:
        raise DataError(f"{csv} holds only the label column {label!r}. Fix: add feature columns to predict from.")
    parts: list[tuple[Path, list[list[str]], list[int]]] = [(Path(csv), rows, lines)]
    if test:
        test_header, test_rows, test_lines = _read(Path(test))
        if test_header != header:
            raise DataError(f"{test} and {csv} have different columns. Fix: use the same header.")
        parts.append((Path(test), test_rows, test_lines))
    j = header.index(label)
    classes = _classes([(p, r[j], n) for p, part, ns in parts for r, n in zip(part, ns, strict=True)], decl)
    xs, ys = [], []
    for p, part, ns in parts:
        bad = next((r[j] for r in part if r[j] not in classes), None)
        if bad is not None:
            raise DataError(f"{p}: label {bad!r}{OWNER} is not one of the declared labels {classes}. Fix: add it.")
        cols = [_column(p, c, [r[i] for r in part], ns, decl) for i, c in enumerate(header) if c != label]
        xs.append(np.concatenate(cols, axis=1))
        ys.append(np.asarray([classes.index(r[j]) for r in part], dtype=np.int64))
    if len(classes) < 2:
        raise DataError(
            f"the label column {label!r} holds {len(classes)} distinct value{OWNER}: a classifier needs two. "
            "Fix: name the column to predict (--label), or declare the labels (schema: labels = [...])."
        )
    xs, ys = (xs, ys) if test else ([xs[0], xs[0][:0]], [ys[0], ys[0][:0]])
    log.warning("%s", notes := describe_schema(header, label, decl, classes))
    tensors = (features_tensor(xs[0]), labels_tensor(ys[0]), features_tensor(xs[1]), labels_tensor(ys[1]))
    files = tuple(str(p[0]) for p in parts)
    return Dataset(csv, *tensors, "classification", len(classes), (xs[0].shape[1],), notes, tuple(classes), files)


def as_factory_table(table: Mapping[str, Any], base_dir: Any) -> dict[str, Any]:
    """A study's ``[data]`` with ``csv = FILE`` as the factory form calling ``load_csv`` (paths: the study's)."""
    out = dict(table)
    if not {"csv", "label"} <= set(out):
        if set(CSV_KEYS) & set(out):
            raise ConfigError('data.csv and data.label go together. Fix: csv = "FILE.csv", label = "COLUMN".')
        return out
    options = {k: out.pop(k) for k in CSV_KEYS if k in out}
    # absolute: a resumed study reads the same file from any folder (found in review)
    options.update(
        {k: str((Path(base_dir or ".") / options[k]).resolve()) for k in ("csv", "test", "schema") if k in options}
    )
    return {**out, "factory": "dptune.data.tabular:load_csv", "options": {**out.get("options", {}), **options}}
