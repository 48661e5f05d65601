"""Every ``dptune …`` command line in README.md and docs/*.md names a real subcommand and only
options that subcommand has.

The commands are not run: the typer app is introspected (``typer.main.get_command`` → click
commands and their parameters). Code blocks and inline code are both read; a doc line that
fails here is a doc that would fail its reader (``--dir`` for ``--out``, ``reproduce --list``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

import pytest
import typer
from conftest import ROOT

from dptune.cli import app

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")  # single-backtick spans; may wrap across lines
SHELL_SEPARATORS = {"&&", "||", "|", ";", "&", ">", ">>", "<", "2>", "2>&1"}


@dataclass(frozen=True)
class DocCommand:
    file: str
    line: int
    text: str  # the command, from ``dptune`` to the end of its shell segment


def _segments(text: str) -> list[list[str]]:
    """Shell-split ``text`` (comments dropped) into commands at ;, &&, |, redirections."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes in prose: read it as plain words
        tokens = text.split()
    out: list[list[str]] = [[]]
    for tok in tokens:
        if tok in SHELL_SEPARATORS or set(tok) <= set("&|;<>"):
            out.append([])
        else:
            out[-1].append(tok)
    return [seg for seg in out if seg]


def _dptune_commands(text: str) -> list[list[str]]:
    """The ``dptune ARGS`` commands in a piece of shell text (``$ `` prompts allowed)."""
    cmds = []
    for seg in _segments(text):
        if seg[0] == "$":
            seg = seg[1:]
        if len(seg) >= 2 and seg[0] == "dptune":
            cmds.append(seg)
    return cmds


def extract_commands(markdown: str, file: str = "<doc>") -> list[DocCommand]:
    """``dptune …`` commands of a markdown text: lines of fenced code blocks (with ``\\``
    continuations joined) and inline code spans that start with ``dptune ``."""
    found: list[DocCommand] = []
    prose: list[tuple[int, str]] = []
    in_block = False
    pending: tuple[int, str] | None = None  # a code line continued with a backslash
    for no, line in enumerate(markdown.splitlines(), 1):
        if FENCE.match(line):
            in_block, pending = not in_block, None
            continue
        if not in_block:
            prose.append((no, line))
            continue
        start, text = (pending[0], pending[1] + " " + line) if pending else (no, line)
        if text.rstrip().endswith("\\"):
            pending = (start, text.rstrip()[:-1])
            continue
        pending = None
        found += [DocCommand(file, start, shlex.join(c)) for c in _dptune_commands(text)]
    # Inline code may wrap across the lines of a paragraph: match on the joined prose.
    offsets, joined = [], ""
    for no, line in prose:
        offsets.append((len(joined), no))
        joined += line + "\n"
    for m in INLINE.finditer(joined):
        # In prose, a|b is a choice (``--executor local|process|ray``), not a pipe.
        span = m.group(1).replace("\\|", "/").replace("|", "/").replace("\n", " ")
        if not span.startswith("dptune "):
            continue
        no = max(n for off, n in offsets if off <= m.start())
        found += [DocCommand(file, no, shlex.join(c)) for c in _dptune_commands(span)]
    return found


def _options(cmd: Any) -> set[str]:
    opts = {"--help"}
    for p in cmd.params:
        if p.param_type_name == "option":  # typer's vendored click: no isinstance on click.Option
            opts.update(p.opts)
            opts.update(p.secondary_opts)
    return opts


def check_command(argv: list[str], root: Any) -> list[str]:
    """What is wrong with ``argv`` (``["dptune", SUBCOMMAND, ...]``) for the app ``root``: an
    unknown subcommand, or an option the (sub)command does not have. [] when it is fine.
    ``dptune tune/resume --x`` (prose for "either") is checked for every alternative."""
    assert argv and argv[0] == "dptune", argv
    rest = argv[1:]
    if not rest or rest[0].startswith("-"):
        return _check_options(root, "dptune", rest)
    problems = []
    for name in rest[0].strip("[]").split("/"):
        sub = root.commands.get(name)
        if sub is None:
            problems.append(f"no subcommand {name!r} (dptune has: {', '.join(sorted(root.commands))})")
        else:
            problems += _check_options(sub, f"dptune {name}", rest[1:])
    return problems


def _check_options(cmd: Any, where: str, tokens: list[str]) -> list[str]:
    known = _options(cmd)
    problems = []
    for tok in tokens:
        flag = tok.strip("[](){},.")
        # A flag: -x or --xyz (optionally =value); not a negative number, a dash, or an ellipsis.
        if not re.match(r"^--?[A-Za-z]", flag):
            continue
        flag = flag.split("=", 1)[0]
        if flag not in known:
            problems.append(f"{where} has no option {flag} (it has: {', '.join(sorted(known))})")
    return problems


ROOT_COMMAND = typer.main.get_command(app)
ALL = [c for doc in DOCS for c in extract_commands(doc.read_text(encoding="utf-8"), doc.relative_to(ROOT).as_posix())]


def test_commands_are_found():
    # The extraction itself is checked: an empty list would make the test below pass vacuously.
    texts = {c.text for c in ALL}
    assert len(ALL) >= 30
    assert "dptune demo" in texts  # README, code block (after &&)
    assert any(c.text.startswith("dptune tune CONFIG --out DIR") and c.file == "docs/tuning.md" for c in ALL)
    assert "dptune reproduce list" in texts  # docs/reproduce.md, code block with a comment
    assert {c.file for c in ALL} >= {
        "README.md",
        "docs/tuning.md",
        "docs/reproduce.md",
        "docs/privacy.md",
    }


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_commands_exist_with_their_options(doc):
    rel = doc.relative_to(ROOT).as_posix()
    bad = [
        f"{c.file}:{c.line}: `{c.text}`: {p}"
        for c in ALL
        if c.file == rel
        for p in check_command(shlex.split(c.text), ROOT_COMMAND)
    ]
    assert not bad, "doc commands that do not match the CLI:\n" + "\n".join(bad)


def test_messages_and_help_in_the_source_name_real_commands():
    # Errors and help strings quote commands in backticks too ("holds no study ... `dptune tune
    # CONFIG --dir DIR`" named an option that does not exist).
    src = ROOT / "src" / "dptune"
    found = [
        c
        for f in sorted(src.rglob("*.py"))
        for c in extract_commands(f.read_text(encoding="utf-8"), f.relative_to(ROOT).as_posix())
    ]
    assert len(found) >= 5  # the extraction works on source text too
    bad = [
        f"{c.file}:{c.line}: `{c.text}`: {p}" for c in found for p in check_command(shlex.split(c.text), ROOT_COMMAND)
    ]
    assert not bad, "commands quoted in the source that do not match the CLI:\n" + "\n".join(bad)


# -- the checker itself must fail on what is wrong ----------------------------------------------


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("dptune tune study.toml --made-up-flag 3", "dptune tune has no option --made-up-flag"),
        (
            "dptune tune CONFIG --dir DIR",
            "dptune tune has no option --dir",
        ),  # the old docs/tuning.md
        ("dptune reproduce --list", "dptune reproduce has no option --list"),
        ("dptune train --epochs=3 --no-such", "dptune train has no option --no-such"),
        ("dptune nosuchcommand --x", "no subcommand 'nosuchcommand'"),
        ("dptune --no-such-root-option", "dptune has no option --no-such-root-option"),
        ("dptune tune/resume --arm x", "dptune resume has no option --arm"),
        ("dptune status/nosuch", "no subcommand 'nosuch'"),
    ],
)
def test_checker_rejects_made_up_commands_and_flags(line, needle):
    problems = check_command(shlex.split(line), ROOT_COMMAND)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    "line",
    [
        "dptune tune study.toml --out runs/s -o runs/s --executor ray --workers 2 --no-progress",
        "dptune train --epochs=3 --hp lr=0.5 --secure --save DIR",
        "dptune reproduce list",
        "dptune account --noise-multiplier 1.1 --sampling-rate 0.01 --steps 1000 --accountant all",
        "dptune --version",
        "dptune calibrate --help",
        "dptune tune/resume --gpus-per-run 0.25",
    ],
)
def test_checker_accepts_real_commands(line):
    assert check_command(shlex.split(line), ROOT_COMMAND) == []


def test_extraction_reads_blocks_continuations_and_wrapped_inline_code():
    md = (
        "Run `dptune tune CONFIG --out DIR [--executor\n"
        "local|process|ray]` then `dptune.load_model(DIR)` and `status DIR`.\n"
        "```bash\n"
        "$ pip install -e . && dptune demo --out d  # a comment --not-a-flag\n"
        "dptune train --epochs 3 \\\n"
        "    --secure | tee log\n"
        "```\n"
        "```python\n"
        "import dptune\n"
        "```\n"
    )
    got = [(c.line, c.text) for c in extract_commands(md)]
    assert got == [
        (4, "dptune demo --out d"),
        (5, "dptune train --epochs 3 --secure"),
        (1, "dptune tune CONFIG --out DIR '[--executor' 'local/process/ray]'"),
    ]
