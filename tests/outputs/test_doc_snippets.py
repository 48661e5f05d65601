"""Every ```python block of README.md and docs/*.md runs as written (issue 27, item 1): copy-paste
works, and snippets and code cannot drift apart.

Each block runs in a fresh namespace, in an empty folder, offline (``DPTUNE_DATA_DIR`` empty,
``DPTUNE_OFFLINE=1``: only the embedded datasets load). The namespace holds only what the reader
brings (``YOURS``: their model class, datasets, model): everything dptune provides must be imported
by the snippet itself. A block that cannot run so (it needs a download, a GPU, a study folder or
minutes) says so in the markdown, on the line before its fence: ``<!-- not run: REASON -->``;
``NOT_RUN`` below lists them, so that a new one is a visible change of this file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from conftest import ROOT
from torch import nn
from torch.utils.data import TensorDataset

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```\s*(\w*)\s*$")
NOT_RUN_MARK = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")


@dataclass(frozen=True)
class Snippet:
    file: str
    line: int  # of the opening fence
    code: str
    not_run: str | None  # the reason given in the markdown, or None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def extract_snippets(markdown: str, file: str = "<doc>") -> list[Snippet]:
    """The ```python blocks of ``markdown``, each with the ``<!-- not run: ... -->`` reason on
    the nearest non-blank line above its fence (None when there is none)."""
    out: list[Snippet] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]))
        if m.group(1) == "python":
            above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = NOT_RUN_MARK.search(above)
            out.append(Snippet(file, i + 1, "\n".join(lines[i + 1 : end]), mark.group(1) if mark else None))
        i = end + 1
    return out


ALL = [s for doc in DOCS for s in extract_snippets(doc.read_text(encoding="utf-8"), doc.relative_to(ROOT).as_posix())]
RUN = [s for s in ALL if s.not_run is None]

# The blocks that do not run here, by the first words of their reason (file → reasons).
NOT_RUN = {
    "docs/data_and_models.md": ["downloads"],
    "docs/reports.md": ["needs a finished study", "a template", "a template", "a template"],
    "docs/reproduce.md": ["the small scale"],
    "docs/tuning.md": ["needs your study file"],
}


def test_snippets_are_found_and_the_not_run_ones_are_listed():
    assert len(ALL) >= 15 and {"README.md", "docs/your_data.md", "docs/accounting.md"} <= {s.file for s in RUN}
    listed = {f: sorted(r) for f, r in NOT_RUN.items()}
    found: dict[str, list[str]] = {}
    for s in ALL:
        if s.not_run is not None:
            found.setdefault(s.file, []).append(next(r for r in listed.get(s.file, [""]) if s.not_run.startswith(r)))
    assert {f: sorted(r) for f, r in found.items()} == listed


def test_extraction_reads_the_not_run_mark_and_skips_other_languages():
    md = "```bash\ndptune demo\n```\n<!-- not run: needs a GPU -->\n\n```python\nx = 1\n```\n```python\ny = 2\n```\n"
    got = extract_snippets(md)
    assert [(s.line, s.code, s.not_run) for s in got] == [(6, "x = 1", "needs a GPU"), (9, "y = 2", None)]


# ----------------------------------------------------------------------------- what the reader brings
class MyNet(nn.Module):
    """The reader's model: 6 features, 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def yours() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2400, 6, generator=g)
    y = (x[:, :3] @ torch.randn(3, 3, generator=g)).argmax(1)
    train, test = TensorDataset(x[:2000], y[:2000]), TensorDataset(x[2000:], y[2000:])
    return {
        "MyNet": MyNet,
        "model": MyNet(),
        "my_dataset": train,
        "my_torch_dataset": train,
        "my_test_dataset": test,
    }


@pytest.mark.parametrize("snippet", RUN, ids=lambda s: s.id)
def test_snippet_runs_as_written(snippet, tmp_path, monkeypatch):
    (tmp_path / "no-data").mkdir()
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(tmp_path / "no-data"))
    monkeypatch.setenv("DPTUNE_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__doc_snippet__", **yours()}
    exec(compile(snippet.code, snippet.id, "exec"), ns)  # a failure names the file and line


def test_the_smoke_scale_billed_as_offline_reads_only_embedded_data(tmp_path, monkeypatch):
    """docs/reproduce.md bills `dptune reproduce galli-mnist --scale smoke` as offline: its data is
    an embedded dataset (it read the full MNIST), and planning it reads nothing else."""
    from dptune.data.registry import DATASETS
    from dptune.presets import plan_preset, preset_parts

    (tmp_path / "no-data").mkdir()
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(tmp_path / "no-data"))
    monkeypatch.setenv("DPTUNE_OFFLINE", "1")
    (part,) = preset_parts("galli-mnist", "smoke")
    assert DATASETS[part.study["data"]["name"]].embedded
    (plan,) = plan_preset("galli-mnist", "smoke").values()
    assert plan.runs and list(tmp_path.joinpath("no-data").iterdir()) == []
    text = (ROOT / "docs" / "reproduce.md").read_text(encoding="utf-8")
    assert "galli-mnist --scale smoke              # ≈ 10 s, offline" in text
