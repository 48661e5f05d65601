"""Issue 10, item 8: the selection data and the preprocessing read no private data unaccounted.

* a holdout carved from the private training data is refused in public mode (one ConfigError
  naming the fix) and, in private mode, assigned per example (add/remove one example moves no
  other one), with every score on it in the plan;
* Adult's numeric scaling and the text 'counts' features are functions of the example alone:
  changing or removing OTHER training examples leaves an example's features bit-identical;
* the report never claims "the selection reads no private data" unconditionally.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA
from tune_helpers import tiny_dpsgd_study

from dptune import data
from dptune.data import formats
from dptune.errors import ConfigError
from dptune.report.html import SELECTION_MODES, SELECTION_SPLITS, render_header
from dptune.tune import SelectionSpec, study_from_dict
from dptune.tune.data import _CACHE, study_data
from dptune.tune.spec import DataSpec
from dptune.tune.study import plan_only

SHARED = SHARED_DATA
needs_shared = pytest.mark.skipif(not (SHARED / "README.md").is_file(), reason=f"no shared data at {SHARED}")


# ------------------------------------------------------------------------------ holdout


def test_public_holdout_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        SelectionSpec(mode="public", split="holdout")
    msg = str(err.value)
    assert msg.startswith("selection.split:") and "private training data" in msg
    assert "Fix: use selection.mode = 'private'" in msg and "split = 'test'" in msg
    # the same error from a config file's dict (what `dptune tune` reads), and the default mode is public
    cfg = {
        "data": {"name": "digits"},
        "model": {"name": "logistic_regression"},
        "training": {"steps": 5, "expected_batch_size": 16},
        "budget": {"epsilon": 1.0, "delta": 1e-5},
        "selection": {"split": "holdout"},
        "strategies": [{"name": "dpsgd", "space": {"lr": [0.1]}}],
    }
    with pytest.raises(ConfigError, match="selection.mode = 'private'"):
        study_from_dict(cfg)
    # private + holdout and public + test are fine
    assert SelectionSpec(mode="private", split="holdout").split == "holdout"
    assert SelectionSpec(mode="public", split="test").mode == "public"


def test_private_holdout_is_planned_and_charged():
    sel = SelectionSpec(mode="private", split="holdout", eval_every=10, noise_multiplier=25.0)
    st = tiny_dpsgd_study(
        data_seed=3,
        n=400,
        dim=5,
        n_train=300,
        lrs=[0.1, 1.0],
        steps=20,
        batch=32,
        eps=3.0,
        selection=sel,
        seeds=(0,),
        name="holdout-plan",
    )
    plan = plan_only(st)
    assert plan.n_train + plan.n_val == 300 and 30 <= plan.n_val <= 90  # Binomial(300, 0.2) ≈ 60 ± 7
    for run in plan.runs.values():  # every score on the holdout is a planned Gaussian release
        assert run.eval_noise_multiplier == 25.0 and len(run.eval_steps) + int(run.eval_final) >= 2


def _split(x: torch.Tensor, y: torch.Tensor, seed: int = 0):
    _CACHE.clear()
    sel = SelectionSpec(mode="private", split="holdout", holdout_fraction=0.25)
    d = study_data(DataSpec(tensors=(x, y, x[:5], y[:5])), sel, seed)
    return d


def _rowset(x: torch.Tensor, y: torch.Tensor) -> set[tuple[float, ...]]:
    return {(*r[:-1].tolist(), int(r[-1])) for r in torch.cat([x, y[:, None].float()], 1)}


def test_holdout_assignment_is_per_example_under_add_remove():
    """Neighbouring datasets (one example removed) give neighbouring training sets OR holdouts.

    A seeded permutation of all n examples (the old split) reshuffles both sets when n changes,
    so the trained models of two neighbours would differ in ~2·f·(1−f)·n examples."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(400, 6, generator=g), torch.randint(0, 3, (400,), generator=g)
    full = _split(x, y)
    tr, ho = _rowset(full.x_train, full.y_train), _rowset(full.x_val, full.y_val)
    assert len(tr) + len(ho) == 400 and 60 <= len(ho) <= 140
    for i in (0, 17, 201, 399):  # remove example i; every other example keeps its side
        keep = torch.arange(400) != i
        d = _split(x[keep], y[keep])
        tr2, ho2 = _rowset(d.x_train, d.y_train), _rowset(d.x_val, d.y_val)
        removed = _rowset(x[i : i + 1], y[i : i + 1])
        assert tr2 == tr - removed and ho2 == ho - removed
        assert (tr2 == tr) != (ho2 == ho)  # exactly one of the two sets changed
    # the study seed keys the hash: another seed gives another holdout
    assert _rowset(_split(x, y, seed=1).x_val, _split(x, y, seed=1).y_val) != ho
    _CACHE.clear()


# ------------------------------------------------------------------------------ adult


@needs_shared
def test_adult_features_do_not_depend_on_other_examples(monkeypatch: pytest.MonkeyPatch):
    """Remove the adult.data row with the largest fnlwgt and raise another row's capital-gain to
    the top code: every other example's features stay bit-identical. Min–max scaling fitted on the
    training split (the old loader) rescales those columns for every example."""
    read = formats.read_adult
    rows0, _ = read(SHARED / "adult" / "adult.data", "adult")
    drop = int(rows0[:, formats.ADULT_COLUMNS.index("fnlwgt")].astype(np.int64).argmax())
    cg = formats.ADULT_COLUMNS.index("capital-gain")
    j = 0 if drop != 0 else 1  # row 0 of adult.data has capital-gain 2174 (< 99999)

    def patched(path, dataset):
        rows, y = read(path, dataset)
        if path.name == "adult.data":
            keep = np.arange(len(rows)) != drop
            rows, y = rows[keep].copy(), y[keep]
            assert int(rows[j, cg]) < 99999
            rows[j, cg] = "99999"
        return rows, y

    # missing='category' + official split: training row i is adult.data row i
    base = data.load("adult", data_dir=SHARED, official_split=True, missing="category")
    monkeypatch.setattr(formats, "read_adult", patched)
    other = data.load("adult", data_dir=SHARED, official_split=True, missing="category")
    expect = base.x_train[torch.arange(base.n_train) != drop]
    assert other.n_train == base.n_train - 1
    changed = torch.nonzero((other.x_train != expect).any(1)).reshape(-1).tolist()
    assert changed == [j]  # only the edited example itself
    assert torch.equal(other.x_test, base.x_test)  # the test split does not see the training split
    assert float(other.x_train.min()) >= 0.0 and float(other.x_train.max()) <= 1.0


def test_adult_scaling_uses_the_published_ranges():
    from dptune.data.loaders import ADULT_NUMERIC, _scale_adult_numeric

    raw = np.array(
        [
            [17, 1, 1, 0, 0, 1],
            [90, 1e7, 16, 99999, 99999, 99],
            [200, 1e9, 40, 1e6, 1e6, 500],
            [53.5, 1e7, 8.5, 0, 0, 50],
        ],
        dtype=np.float64,
    )
    out = _scale_adult_numeric(raw)
    assert out.shape == (4, len(ADULT_NUMERIC))
    assert np.array_equal(out[0], np.zeros(6)) and np.array_equal(out[1], np.ones(6))
    assert np.array_equal(out[2], np.ones(6))  # clipped to the a-priori range
    assert out[3, 0] == pytest.approx(0.5) and out[3, 2] == pytest.approx(0.5) and out[3, 5] == pytest.approx(0.5)
    # log1p columns: capital-gain 999 -> log1p(999)/log1p(99999)
    assert _scale_adult_numeric(np.array([[17, 1, 1, 999, 0, 1]], float))[0, 3] == pytest.approx(
        np.log1p(999) / np.log1p(99999)
    )


# ------------------------------------------------------------------------------- text


@needs_shared
def test_text_counts_do_not_depend_on_other_documents(monkeypatch: pytest.MonkeyPatch):
    """Replace one Enron message by a long one of new and frequent tokens: every OTHER message's
    features stay bit-identical (a vocabulary of the most frequent training tokens and a
    per-column maximum, the old featurisation, both move)."""
    read = formats.read_enron_csv
    base = data.load("enron_spam", data_dir=SHARED, limit=600)

    def patched(path, dataset):
        names, texts, y = read(path, dataset)
        texts = list(texts)
        texts[base_idx] = "subject : zzqxj " + "zzqxj the " * 5000
        return names, texts, y

    from dptune.data.dataset import subset_indices

    base_idx = int(subset_indices(5172, 600, 0)[3])  # a message inside the subset
    monkeypatch.setattr(formats, "read_enron_csv", patched)
    other = data.load("enron_spam", data_dir=SHARED, limit=600)
    both_a = torch.cat([base.x_train, base.x_test])
    both_b = torch.cat([other.x_train, other.x_test])
    assert both_a.shape == both_b.shape == (600, 5512)
    assert int((both_a != both_b).any(1).sum()) == 1  # only the replaced message
    assert float(both_b.min()) >= 0.0 and float(both_b.max()) <= 1.0
    norms = both_b.norm(dim=1)
    assert torch.allclose(norms[norms > 0], torch.ones_like(norms[norms > 0]), atol=1e-5)  # unit L2
    assert "HashingVectorizer" in other.notes and "no privacy cost" in other.notes


def test_glove_note_holds_no_statistic_of_the_texts(tmp_path: Path):
    from dptune.data import text

    glove = tmp_path / "g.txt"
    glove.write_text("hello 1 2 3\n")
    _, note = text.bow_embedding(["hello a b c d", "e f g"], max_words=4, embed_dim=3, glove_path=glove)
    assert not any(ch.isdigit() for ch in note.replace(str(glove), ""))  # no OOV count of private texts


# ------------------------------------------------------------------------------ report


def test_report_does_not_claim_public_selection_reads_no_private_data():
    public = SELECTION_MODES["public"]
    assert "reads no private" not in public
    assert "ASSUMED PUBLIC" in public and "NOT covered by the guarantee" in public
    assert "private training data" in SELECTION_SPLITS["holdout"] and "charged" in SELECTION_SPLITS["holdout"]
    html = render_header(selection_mode="public", selection_split="test", planned=None, spent=None)
    assert "ASSUMED PUBLIC" in html and "reads no private" not in html
