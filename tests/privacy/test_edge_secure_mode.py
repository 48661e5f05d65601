"""Issue 10, item 3: secure mode covers the Poisson batches too, and users can reach it.

With ``secure_mode=True`` the sampler used to stay seeded from the public seed: anyone holding
the seed could regenerate every batch, and amplification by subsampling was lost. Checked here:
* two secure runs with the same seed draw different batches (fails on the old code: the
  realised batch sizes were identical); seeded runs still reproduce (control);
* the secure sampler reads only the OS CSPRNG (with os.urandom replaced by fixed bytes, the
  seed makes no difference) and has the exact Poisson subset law (χ² over all 2⁵ subsets, a
  test that rejects a 10% higher rate); ``train_many`` trials are covered too;
* ``dptune train --secure`` end to end: the release JSON states the mode; a seeded run's JSON
  and console warn that the seed is a secret key;
* ``[study] secure = true`` parses (bad values named), keeps old fingerprints, reaches the
  workers (training, vectorised groups, private-selection noise) and survives a resume; the
  study report states the mode, and warns in seeded mode.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import invoke_train
from scipy import stats
from tune_helpers import tiny_dpsgd_study

from dptune.errors import ConfigError
from dptune.release.sampling import PoissonSampler
from dptune.train import train
from dptune.tune import SelectionSpec, run_study
from dptune.tune.spec import study_from_dict

# ----------------------------------------------------------------------------- the sampler


def _toy(n: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _batch_sizes(secure: bool, seed: int = 11) -> list[int]:
    torch.manual_seed(0)
    res = train(
        torch.nn.Linear(5, 3),
        _toy(),
        "dpsgd",
        steps=12,
        expected_batch_size=40,
        noise_multiplier=1.0,
        seed=seed,
        device="cpu",
        secure_mode=secure,
    )
    assert res.secure_mode is secure
    return [row["batch_size"] for row in res.history]


def test_secure_runs_draw_different_batches_with_the_same_seed() -> None:
    assert _batch_sizes(False) == _batch_sizes(False)  # control: seeded batches reproduce
    a, b = _batch_sizes(True), _batch_sizes(True)
    assert a != b  # the old code drew these from the seed: identical
    # 12 Binomial(200, 0.2) sizes: equal sequences by chance has probability < 1e-12


def test_secure_sampler_reads_only_the_os_csprng(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []

    def fixed_bytes(n: int) -> bytes:
        reads.append(n)
        return np.random.default_rng(len(reads)).bytes(n)

    monkeypatch.setattr(os, "urandom", fixed_bytes)
    a = [PoissonSampler(1000, 0.1, seed=1, secure=True).sample() for _ in range(1)][0]
    assert reads
    reads.clear()
    b = PoissonSampler(1000, 0.1, seed=999, secure=True).sample()
    assert torch.equal(a, b)  # same OS bytes, different seeds: same batch. The seed is unused.
    reads.clear()
    PoissonSampler(1000, 0.1, seed=1).sample()
    assert not reads  # control: the seeded sampler does not read the OS CSPRNG
    with pytest.raises(RuntimeError, match="no state"):
        PoissonSampler(10, 0.5, seed=1, secure=True).state()


@pytest.mark.parametrize("q", [0.5, 1.0])
def test_secure_steps_seed_the_forward_randomness_from_the_os_csprng(q: float) -> None:
    """Dropout masks come from torch's generators: a user's known ``torch.manual_seed`` fixed them, and
    with known masks one example moved the others' (9.3·C in review). Each secure step reseeds them."""
    import random

    draws = []
    for secure in (True, True, False, False):
        torch.manual_seed(1234), np.random.seed(1234), random.seed(1234)
        PoissonSampler(100, q, seed=1, secure=secure).sample()
        draws.append(
            torch.cat([torch.rand(4), torch.from_numpy(np.random.rand(2)).float(), torch.tensor([random.random()])])
        )
    assert not (draws[0] == draws[1]).any()  # torch's, numpy's and random's (Hugging Face audio masks) alike
    # Seeded: from the secret seed, not the caller's torch seed (found in review: a published torch.manual_seed
    # fixed the masks, and one example moved the pre-noise sum by 16·C); the same seed, the same masks.
    torch.manual_seed(1234)
    assert torch.equal(draws[2], draws[3]) and not torch.equal(draws[2][:4], torch.rand(4))
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    PoissonSampler(100, q, seed=1, secure=False).sample()
    assert torch.equal(torch.rand(4), draws[2][:4])  # another caller seed: the same masks
    PoissonSampler(100, q, seed=2, secure=False).sample()
    assert not torch.equal(torch.rand(4), draws[2][:4])  # another secret seed: other masks


def test_a_run_leaves_the_callers_random_streams_as_they_were() -> None:
    """Found in review: after a secure run torch.initial_seed() was the last step's secret mask seed (and numpy's
    and random's states followed it): logging it replayed that step's masks. A run restores the caller's."""
    import random

    x, y = torch.randn(60, 5), torch.randint(0, 2, (60,))
    for secure in (True, False):
        torch.manual_seed(5), np.random.seed(5), random.seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
        before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
        train(model, (x, y), "dpsgd", steps=3, expected_batch_size=20, noise_multiplier=1.0, secure_mode=secure)
        assert torch.equal(torch.get_rng_state(), before[0]) and torch.initial_seed() == 5
        assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]


def _subset_law_pvalue(draw, n: int, q: float, draws: int) -> float:
    """χ² p-value of the observed subsets of range(n) against q^|S|(1−q)^(n−|S|)."""
    counts = Counter(tuple(draw().tolist()) for _ in range(draws))
    subsets = [tuple(i for i in range(n) if mask >> i & 1) for mask in range(2**n)]
    assert set(counts) <= set(subsets)
    expected = np.array([draws * q ** len(S) * (1 - q) ** (n - len(S)) for S in subsets])
    return float(stats.chisquare([counts.get(S, 0) for S in subsets], expected).pvalue)


@pytest.mark.parametrize(("q", "draws"), [(0.05, 60_000), (0.3, 20_000), (0.9, 20_000)])
def test_secure_sampler_has_the_exact_subset_law(q: float, draws: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The secure code path on a fixed byte stream (os.urandom replaced by seeded bytes), so the
    outcome is reproducible. draws: the noncentral χ² power to reject the 10% higher rate at
    level 1e-4 is ≥ 1 − 1e-8 (at q = 0.05, 20,000 draws would give only 0.81)."""
    rng = np.random.default_rng(2024)
    monkeypatch.setattr(os, "urandom", lambda k: rng.bytes(k))
    n = 5
    assert _subset_law_pvalue(PoissonSampler(n, q, seed=0, secure=True).sample, n, q, draws) > 1e-4
    wrong = PoissonSampler(n, min(q * 1.1, 0.99), seed=0, secure=True)  # power: a 10% higher rate
    assert _subset_law_pvalue(wrong.sample, n, q, draws) < 1e-4


def test_seeded_sampler_reproduces_and_state_round_trips() -> None:
    a, b = PoissonSampler(500, 0.2, seed=3), PoissonSampler(500, 0.2, seed=3)
    assert all(torch.equal(a.sample(), b.sample()) for _ in range(5))
    st = a.state()
    x = a.sample()
    a.set_state(st)
    assert torch.equal(a.sample(), x)


def test_train_many_trials_in_secure_mode_draw_fresh_batches() -> None:
    from dptune.vectorized import train_many

    def sizes(secure: bool) -> list[list[int]]:
        torch.manual_seed(0)
        res = train_many(
            lambda s: torch.nn.Linear(5, 3),
            _toy(),
            "dpsgd",
            configs=[{"lr": 0.1}, {"lr": 0.2}],
            seeds=[1, 2],
            steps=8,
            expected_batch_size=40,
            noise_multiplier=1.0,
            device="cpu",
            secure_mode=secure,
        )
        assert all(r.secure_mode is secure for r in res)
        return [[row["batch_size"] for row in r.history] for r in res]

    assert sizes(False) == sizes(False)
    assert sizes(True) != sizes(True)


# ----------------------------------------------------------------------------- dptune train --secure
def _cli_train(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "run.json"
    res = invoke_train(out, "--device", "cpu", *extra, epochs="0.1", eval_every="5")
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(out.read_text()), res.output


def test_cli_train_secure_states_the_mode_and_seeded_warns(tmp_path: Path) -> None:
    rel, output = _cli_train(tmp_path / "secure", "--secure")
    assert rel["randomness"] == "secure" and "CSPRNG" in rel["randomness_note"]
    assert "secret key" not in output
    rel, output = _cli_train(tmp_path / "seeded")
    assert rel["randomness"] == "seeded" and "secret key" in rel["randomness_note"]
    assert "secret key" in " ".join(output.split())  # the console warns too
    assert "seed" not in {k.lower() for k in rel}  # the release JSON does not publish the key


# ----------------------------------------------------------------------------- [study] secure
def _study_dict(**study: object) -> dict:
    return {
        "study": {"name": "s", "seeds": [0], **study},
        "data": {"name": "digits"},
        "model": {"name": "logistic_regression"},
        "training": {"steps": 5, "expected_batch_size": 32},
        "budget": {"epsilon": 2.0, "delta": 1e-5},
        "strategies": [{"name": "dpsgd", "space": {"lr": [0.1]}}],
    }


def test_study_secure_field_parses_validates_and_keeps_old_fingerprints() -> None:
    plain = study_from_dict(_study_dict())
    secure = study_from_dict(_study_dict(secure=True))
    assert plain.secure is False and secure.secure is True
    assert "secure" not in plain.to_dict()["study"]  # studies stored before the field stay resumable
    assert secure.to_dict()["study"]["secure"] is True and plain.fingerprint() != secure.fingerprint()
    assert study_from_dict(secure.to_dict()).secure is True  # what resume reads back
    with pytest.raises(ConfigError, match=r"study\.secure"):
        study_from_dict(_study_dict(secure="yes"))


def _tiny(secure: bool, name: str):
    return tiny_dpsgd_study(
        data_seed=0,
        n=300,
        dim=5,
        n_train=220,
        lrs=[0.2, 1.0],
        steps=12,
        batch=30,
        eps=2.0,
        selection=SelectionSpec(mode="private", eval_every=6, noise_multiplier=30.0),
        seeds=(0,),
        name=name,
        secure=secure,
    )


def test_secure_study_reaches_the_workers_and_its_report_states_the_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dptune.report import report_study
    from dptune.tune import worker
    from dptune.tune.store import Store

    seen: dict[str, list[bool]] = {"runs": [], "selection_noise": []}
    real_loop, real_noise = worker.RunLoop, worker.NoiseSource

    def spy_loop(*args, **kwargs):  # every run of the worker is a RunLoop
        seen["runs"].append(kwargs["secure_mode"])
        return real_loop(*args, **kwargs)

    def spy_noise(*args, **kwargs):
        seen["selection_noise"].append(kwargs.get("secure", False))
        return real_noise(*args, **kwargs)

    monkeypatch.setattr(worker, "RunLoop", spy_loop)
    monkeypatch.setattr(worker, "NoiseSource", spy_noise)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        run_study(_tiny(True, "sec"), d, progress=False)
    assert seen["runs"] and all(seen["runs"]) and seen["selection_noise"] == [True] * 4
    with Store(dirs[0]) as st:  # what resume rebuilds the study from (study_from_dict: tested above)
        assert st.get_meta("config")["study"]["secure"] is True

    def histories(d: Path) -> list[str]:
        with Store(d) as s:
            return [r["history"] for r in s.runs()]

    assert histories(dirs[0]) != histories(dirs[1])  # same seeds, fresh batches and noise
    page = report_study(dirs[0]).read_text()
    assert "secure mode" in page and "CSPRNG" in page and "secret key" not in page

    seeded = tmp_path / "seeded"
    run_study(_tiny(False, "plain"), seeded, progress=False)
    assert seen["runs"][-1] is False
    page = report_study(seeded).read_text()
    assert "secret key" in page
    # The presets' page (dptune demo / reproduce) and the terminal table state the mode too.
    from rich.console import Console

    from dptune.presets._report import study_report
    from dptune.tune.results import render

    assert "secret key" in study_report(seeded, tmp_path / "preset-page").read_text()
    assert "CSPRNG" in study_report(dirs[0], tmp_path / "preset-page-secure").read_text()
    for d, word in ((seeded, "secret key"), (dirs[0], "CSPRNG")):
        con = Console(width=100, record=True)
        render(d, con)
        assert word in " ".join(con.export_text().split())


def test_tiny_sampling_rate_never_gives_out_of_range_indices() -> None:
    """Gaps E/λ beyond int64 (q ≈ 1e-19) are capped at n before the cast: no wrapped indices."""
    s = PoissonSampler(10, 1e-19, 0)
    for _ in range(200):
        idx = s.sample()
        assert bool(((idx >= 0) & (idx < 10)).all())
