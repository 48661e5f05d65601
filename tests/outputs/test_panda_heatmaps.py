"""Panda et al.'s η × T heatmaps per ε (Fig. 5/15/16) and the iterate-averaging ablation arm.

* the heatmap cells are the grid runs' selection scores (mean over seed replicates), the best
  cell is the grid's best, and each panel states the ε the grid is covered at (the oracle's
  honest composed total, not the per-run ε);
* public selection: the figure is in ``release/figures`` and in the part's report figures;
  private selection: in ``diagnostics/figures`` only, labelled, and never in the release;
* option ``average`` adds a ``grid-oracle-ema``/``-swa`` arm (same grid, DP-GD with averaging);
  a wrong value, or the option on another preset, is one clear error (exit code 2 on the CLI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tune_helpers import make_study
from typer.testing import CliRunner

from dptune.cli import app
from dptune.errors import ConfigError
from dptune.outputs import NOT_DP_LABEL
from dptune.presets import panda, preset_parts
from dptune.tune import MethodSpec, SelectionSpec, StrategyArm, Study, TrainingSpec, run_study
from dptune.tune.results import study_table
from dptune.tune.store import Store

pytestmark = pytest.mark.usefixtures("one_thread")

LRS, STEPS, EPS = [0.1, 1.0], [3, 6], (1.0, 4.0)


def _study(mode: str) -> Study:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 5, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return make_study(
        (x[:120], y[:120], x[120:], y[120:]),
        arms=(
            StrategyArm("dpgd", label="grid-oracle", space={"lr": LRS, "steps": STEPS}, method=MethodSpec("oracle")),
        ),
        training=TrainingSpec(steps=6, full_batch=True),
        eps=EPS,
        accountant="auto",
        selection=SelectionSpec(mode=mode, split="test", checkpoint="final"),
        name=f"heatmap-{mode}",
    )


@pytest.fixture(scope="module")
def public_study(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("public") / "s"
    assert run_study(_study("public"), d, progress=False).complete
    return d


def test_cells_are_the_grid_runs_scores_and_panels_state_the_composed_epsilon(public_study: Path) -> None:
    grids = panda.eta_t_grids(public_study)
    assert sorted(g["epsilon"] for g in grids) == list(EPS) and {g["label"] for g in grids} == {"grid-oracle"}
    with Store(public_study, readonly=True) as store:
        runs = [dict(r) for r in store.runs()]
    table = {r["epsilon"]: r for r in study_table(public_study)}
    for g in grids:
        assert set(g["cells"]) == {(lr, t) for lr in LRS for t in STEPS} and g["runs"] == 4
        mine = [r for r in runs if r["arm"].endswith(f"eps={g['epsilon']:g}")]
        assert len(mine) == 4
        for r in mine:
            c = json.loads(r["config"])
            assert g["cells"][(c["lr"], c["steps"])] == r["score"]
        best = max((v, k) for k, v in g["cells"].items() if v is not None)[1]
        assert g["best"] == best
        # Covered at the grid's composition (the oracle's honest total), well above the per-run ε.
        assert g["covered"] == table[g["epsilon"]]["planned_epsilon"] > g["epsilon"] * 1.2
        assert g["kind"] == "composition" and g["mode"] == "public"


def test_public_selection_releases_the_figure_with_its_coverage(public_study: Path) -> None:
    ref, released = panda.eta_t_heatmaps(public_study)
    assert released and ref is not None
    assert ref.path == public_study / "release" / "figures" / panda.HEATMAP_FILE and ref.path.stat().st_size > 5000
    assert "covered only at the composition" in ref.caption and NOT_DP_LABEL not in ref.caption
    assert not (public_study / "diagnostics" / "figures" / panda.HEATMAP_FILE).exists()
    assert [f.path.name for f in panda.report_figures(public_study)] == [panda.HEATMAP_FILE]  # no linear-scaling arm


def test_private_selection_keeps_the_figure_in_the_diagnostics(tmp_path: Path) -> None:
    d = tmp_path / "s"
    assert run_study(_study("private"), d, progress=False).complete
    ref, released = panda.eta_t_heatmaps(d)
    assert not released and ref is not None
    assert ref.path == d / "diagnostics" / "figures" / panda.HEATMAP_FILE and ref.path.is_file()
    assert ref.caption.startswith(NOT_DP_LABEL)
    assert not (d / "release" / "figures" / panda.HEATMAP_FILE).exists()
    assert all(f.path.name != panda.HEATMAP_FILE for f in panda.report_figures(d))
    assert (d / "diagnostics" / "README.txt").is_file()


def test_a_study_without_a_grid_over_eta_and_t_has_no_heatmap(tmp_path: Path) -> None:
    st = _study("public")
    st = Study(**{**st.__dict__, "strategies": (StrategyArm("dpgd", space={"lr": LRS}, method=MethodSpec("grid")),)})
    d = tmp_path / "s"
    assert run_study(st, d, progress=False).complete
    assert panda.eta_t_grids(d) == [] and panda.eta_t_heatmaps(d) == (None, False)


@pytest.mark.parametrize("average", ["ema", "swa"])
def test_the_averaging_option_adds_an_ablation_arm(average: str) -> None:
    for name in ("panda-linear-scaling-mnist", "panda-linear-scaling-text"):
        for part in preset_parts(name, "smoke", average=average):
            arms = {a["label"]: a for a in part.study["strategies"]}
            assert list(arms) == ["linear-scaling", "random-search", "grid-oracle", f"grid-oracle-{average}"]
            abl, orc = arms[f"grid-oracle-{average}"], arms["grid-oracle"]
            assert abl["fixed"] == {**orc["fixed"], "average": average}
            assert abl["space"] == orc["space"] and abl["method"] == orc["method"] == {"name": "oracle"}
            assert any("Fig. 11" in n for n in part.notes)
    plain = preset_parts("panda-linear-scaling-mnist", "smoke")[0]
    assert [a["label"] for a in plain.study["strategies"]] == ["linear-scaling", "random-search", "grid-oracle"]


def test_a_wrong_averaging_option_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Fix: use 'ema' or 'swa'"):
        preset_parts("panda-linear-scaling-mnist", "smoke", average="mean")
    for name, value, message in (
        ("galli-mnist", "ema", "has no option 'average'"),
        ("panda-linear-scaling-mnist", "mean", "Fix: use 'ema' or 'swa'"),
    ):
        out = tmp_path / name
        res = CliRunner().invoke(app, ["reproduce", name, "--average", value, "--out", str(out), "--no-progress"])
        assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, res.output
        assert not out.exists()  # refused before any folder is made
