"""Your own CSV file as a ``Dataset``, through a public preprocessing schema (docs/your_data.md).

The schema is a function of the header and of your declarations only, never of the private rows:
a numeric column with declared bounds ``[lo, hi]`` is clipped to them and scaled to [0, 1], one
without is used as it is (no scaling); a column of declared categories is one-hot encoded over them
(in the declared order); any other column must hold numbers. The label set is the declared
``labels`` (in that order), else the sorted distinct labels of the files (numerically when all are
numbers): that set is read from the private rows, and docs/privacy.md says what it reveals.
"""

from __future__ import annotations

import csv
import logging
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dptune.data.dataset import Dataset, features_tensor, labels_tensor
from dptune.errors import ConfigError, DataError

log = logging.getLogger("dptune")


def _read(path: Path) -> tuple[list[str], list[list[str]]]:
    """(header, rows of strings); a missing, empty or ragged file is one ``DataError``."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            table = [[v.strip() for v in row] for row in csv.reader(fh) if any(v.strip() for v in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"cannot read the CSV file {path}: {exc}. Fix: pass a readable UTF-8 CSV file.") from exc
    if len(table) < 2:
        raise DataError(f"{path} holds no data rows. Fix: a header line, then one line per example.")
    for i, row in enumerate(table[1:], 2):
        if len(row) != len(table[0]):
            raise DataError(f"{path}, line {i}: {len(row)} fields, the header has {len(table[0])}. Fix: that line.")
    return table[0], table[1:]


def _number(value: str, where: str, column: str) -> float:
    try:
        out = float(value)
    except ValueError:
        out = float("nan")
    if not np.isfinite(out):
        raise DataError(
            f"{where}: column {column!r} holds {value!r}, not a finite number. Fix: correct the value, or declare "
            f"the column categorical (categories.{column} = [...], --schema in the CLI)."
        )
    return out


def _encode(path: Path, header: list[str], rows: list[list[str]], schema: dict[str, Any]) -> np.ndarray:
    blocks = []
    for j, col in enumerate(header):
        if col == schema["label"]:
            continue
        values = [r[j] for r in rows]
        if col in schema["categories"]:
            cats = [str(c) for c in schema["categories"][col]]
            bad = next((v for v in values if v not in cats), None)
            if bad is not None:
                raise DataError(
                    f"{path}: column {col!r} holds {bad!r}, not one of its declared categories {cats}. Fix: add it."
                )
            blocks.append(np.asarray([[v == c for c in cats] for v in values], dtype=np.float64))
            continue
        x = np.asarray([_number(v, f"{path}, line {i}", col) for i, v in enumerate(values, 2)])
        if col in schema["numeric"]:
            lo, hi = (float(b) for b in schema["numeric"][col])
            x = (np.clip(x, lo, hi) - lo) / (hi - lo)
        blocks.append(x[:, None])
    return np.concatenate(blocks, axis=1) if blocks else np.zeros((len(rows), 0))


def _schema(header: list[str], label: str, options: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The checked declarations: numeric {col: [lo, hi]}, categories {col: [...]}, labels [...] or None."""
    if label not in header:
        raise DataError(f"{path} has no label column {label!r}; its columns are {header}. Fix: --label COLUMN.")
    numeric, categories = dict(options.get("numeric") or {}), dict(options.get("categories") or {})
    for col in [*numeric, *categories]:
        if col not in header or col == label:
            raise DataError(f"the schema declares column {col!r}, not a feature column of {path}. Fix: the schema.")
    for col, b in numeric.items():
        if not (isinstance(b, Sequence) and len(b) == 2 and float(b[0]) < float(b[1])):
            raise DataError(f"numeric.{col} = {b!r}: Fix: declare public bounds [lo, hi], lo < hi.")
    for col, cats in categories.items():
        if col in numeric or not isinstance(cats, Sequence) or isinstance(cats, str) or not cats:
            raise DataError(f"categories.{col} = {cats!r}: Fix: a non-empty list of values, no bounds.")
    labels = options.get("labels")
    return {"label": label, "numeric": numeric, "categories": categories, "labels": labels}


def describe_schema(header: list[str], schema: dict[str, Any], classes: list[str], declared: bool) -> str:
    """The schema in words, one column a line (what ``load_csv`` logs and keeps in ``Dataset.notes``)."""
    lines = []
    for col in header:
        if col == schema["label"]:
            how = f"label: {len(classes)} classes {classes} " + (
                "(declared)" if declared else "(the sorted distinct values of the files: not a public declaration)"
            )
        elif col in schema["categories"]:
            how = f"one-hot over the declared categories {list(schema['categories'][col])}"
        elif col in schema["numeric"]:
            how = "numeric, clipped to the declared [{}, {}] and scaled to [0, 1]".format(*schema["numeric"][col])
        else:
            how = "numeric, as it is (no declared bounds: no scaling)"
        lines.append(f"  {col}: {how}")
    return "CSV schema (public: from the header and your declarations, not fitted on the rows):\n" + "\n".join(lines)


def _classes(values: list[str], declared: Any) -> list[str]:
    if declared is not None:
        return [str(v) for v in declared]
    distinct = sorted(set(values))
    try:
        return sorted(distinct, key=float)
    except ValueError:
        return distinct


def load_csv(
    csv: str,
    *,
    label: str,
    test: str | None = None,
    schema: str | None = None,
    numeric: Mapping[str, Sequence[float]] | None = None,
    categories: Mapping[str, Sequence[str]] | None = None,
    labels: Sequence[str] | None = None,
) -> Dataset:
    """The file ``csv`` (and ``test``, a CSV file with the same header) as a classification ``Dataset``.

    ``schema``: a TOML file with the declarations ``numeric``, ``categories`` and ``labels``;
    the keyword arguments of the same names take precedence. Without a ``test`` file the test
    split is empty. Raises ``DataError`` for a bad file and logs the schema it used.
    """
    options: dict[str, Any] = {}
    if schema is not None:
        try:
            options.update(tomllib.loads(Path(schema).read_text(encoding="utf-8")))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise DataError(f"cannot read the schema file {schema}: {exc}. Fix: pass a TOML file.") from exc
    given = {"numeric": numeric, "categories": categories, "labels": labels}
    options.update({k: v for k, v in given.items() if v is not None})
    path = csv
    header, rows = _read(Path(path))
    spec = _schema(header, label, options, Path(path))
    parts = [(Path(path), rows)]
    if test is not None:
        test_header, test_rows = _read(Path(test))
        if test_header != header:
            raise DataError(f"{test} has the columns {test_header}, {path} has {header}. Fix: use the same header.")
        parts.append((Path(test), test_rows))
    j = header.index(label)
    classes = _classes([r[j] for _, part in parts for r in part], spec["labels"])
    xs, ys = [], []
    for p, part in parts:
        bad = next((r[j] for r in part if r[j] not in classes), None)
        if bad is not None:
            raise DataError(f"{p}: label {bad!r} is not one of the declared labels {classes}. Fix: add it.")
        xs.append(_encode(p, header, part, spec))
        ys.append(np.asarray([classes.index(r[j]) for r in part], dtype=np.int64))
    if len(parts) == 1:
        xs.append(xs[0][:0])
        ys.append(ys[0][:0])
    notes = describe_schema(header, spec, classes, spec["labels"] is not None)
    log.warning("%s", notes)
    return Dataset(
        name=str(path),
        x_train=features_tensor(xs[0]),
        y_train=labels_tensor(ys[0]),
        x_test=features_tensor(xs[1]),
        y_test=labels_tensor(ys[1]),
        task="classification",
        num_classes=len(classes),
        input_shape=(int(xs[0].shape[1]),),
        notes=notes,
        class_names=tuple(classes),
        files=tuple(str(p) for p, _ in parts),
    )


CSV_KEYS = ("csv", "label", "test", "schema", "numeric", "categories", "labels")


def as_factory_table(table: Mapping[str, Any], base_dir: str | Path | None) -> dict[str, Any]:
    """A study's ``[data]`` with ``csv = "FILE.csv"`` as the factory form that calls ``load_csv``
    (relative file names are relative to the study file's folder); any other table as it is."""
    out = dict(table)
    if "csv" not in out:
        stray = sorted(set(CSV_KEYS) & set(out))
        if stray:
            raise ConfigError(f'data.{stray[0]} goes with data.csv. Fix: add csv = "FILE.csv" to [data].')
        return out
    if "label" not in out:
        raise ConfigError('data.csv needs its label column. Fix: add label = "COLUMN" to [data].')
    options = {k: out.pop(k) for k in CSV_KEYS if k in out}
    for k in ("csv", "test", "schema"):
        if k in options and base_dir is not None:
            options[k] = str(Path(base_dir) / Path(options[k]).expanduser())
    return {**out, "factory": "dptune.data.tabular:load_csv", "options": {**out.get("options", {}), **options}}
