"""``dptune`` command line: a thin layer over the Python API.

Every user error is printed as one red line naming the fix (exit code 2); no traceback."""

from __future__ import annotations

import functools
import json
import sqlite3
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from dptune.accounting_text import PLD_EPSILON_CAP  # noqa: F401 (a public name of this module)
from dptune.errors import DPTuneError
from dptune.outputs import (
    DIAGNOSTICS_DIR,
    NOT_DP_LABEL,
    check_data_dir,
    check_output_dir,
    check_output_file,
    check_train_options,
    checkpoint_rule,
    parse_hyperparameters,
    print_table,
    publish_note,
    refuse_foreign_dir,
    refuse_inside_release,
    release_dir,
    resume_hint,
    strict_json,
    terminal_console,
    train_output_paths,
    train_table_rows,
    up,
    wrap_to_terminal,
    write_train_outputs,
)
from dptune.study_args import check_study_options, check_study_path

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Differentially private training and honest hyperparameter tuning.",
    pretty_exceptions_enable=False,
)
# The terminal's width or COLUMNS; when piped without COLUMNS, 100 columns (not rich's 80).
console = terminal_console()
err_console = terminal_console(stderr=True)


def _print_version(value: bool) -> None:
    """The installed distribution's version (what pip sees), else the source tree's."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("dptune")
    except PackageNotFoundError:  # run from a source tree that was not pip-installed
        from dptune._version import __version__ as installed
    typer.echo(f"dptune {installed}")
    raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    # Commands import torch etc. in their bodies: --help and --version start fast (tests/cli/test_cli_startup.py).
    # text wrapped to the terminal (COLUMNS in a log), not a source line
    warnings.formatwarning = lambda msg, *_a, **_k: wrap_to_terminal(f"warning: {msg}") + "\n"


def _say_interrupted(msg: str) -> None:  # Ctrl-C in a study (outputs.resume_hint)
    err_console.print(f"[bold yellow]interrupted[/]: {escape(msg)}", highlight=False, soft_wrap=True)


def _guard(fn):
    """Turn dptune's own errors (and bad values, a full disk) into one clear line."""
    import errno

    full_os, full_db = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}, ("or disk is full", "disk I/O error")
    study = fn.__name__ in ("tune", "resume")  # a study keeps its finished runs; `train` loses its run

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (DPTuneError, ValueError, KeyError, sqlite3.OperationalError, OSError) as e:
            msg = str(e) if not isinstance(e, KeyError) else f"missing key {e}"
            if isinstance(e, sqlite3.OperationalError | OSError) and not isinstance(e, FileNotFoundError):
                if not (e.errno in full_os if isinstance(e, OSError) else any(m in msg for m in full_db)):
                    raise  # e.g. your dataset's PermissionError, a locked store: not a full disk (found in review)
                d = (kwargs.get("study_dir") or kwargs.get("out")) if study else None
                again = f"`dptune resume {d}`" if d and (Path(d) / "study.sqlite").exists() else "the command again"
                kept = "; nothing finished is lost" if study else ""
                msg = f"{e}: the disk is full or not writable{kept}. Fix: free space, then {again}."
            # escape: "[budget]" is text, not markup; soft_wrap: one line however narrow the terminal.
            err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:  # files are written whole or not at all; a study says how to resume
            _say_interrupted("files it had not finished were not written (those finished are kept).")
            raise SystemExit(130) from None

    return wrapper


@app.command()
@_guard
def train(
    dataset: str = typer.Option("mnist5k", help="dataset name (dptune.data), e.g. mnist5k, digits, mnist"),
    data: str | None = typer.Option(
        None,
        "--data",
        help="your own data instead of --dataset: FILE.csv (with --label), or pkg.module:loader, "
        "loader() -> (train, test) (docs/your_data.md); the module must be importable",
    ),
    label: str | None = typer.Option(None, help="--data FILE.csv: the label column"),
    test: str | None = typer.Option(None, help="--data FILE.csv: a test CSV with the same columns (private)"),
    schema: str | None = typer.Option(None, help="--data FILE.csv: TOML of numeric bounds, categories, labels"),
    eval_public: bool = typer.Option(False, "--eval-public", help="declare --data's test split public (else private)"),
    checkpoint: str | None = typer.Option(None, help="final, or best on a public test split (its default)"),
    model: str = typer.Option(
        "auto",
        help="model name (dptune.models), 'auto' for the dataset's default, or your "
        "own pkg.module:factory (factory() -> nn.Module; input_dim/classes passed if taken)",
    ),
    strategy: str = typer.Option(
        "dpsgd",
        help="nodp, dpsgd, quantile, oso, dpadam, adamwosm, adadp, dpgd, dpzo, or a composition <privatizer>+<update> (privatizer: fixed, quantile, oso; update: sgd, adam, adamwosm, oso_rate, adadp), e.g. oso+adam",
    ),
    epsilon: float | None = typer.Option(
        3.0, "--target-epsilon", "--epsilon", help="target ε of this run (ignored with --noise-multiplier)"
    ),
    delta: float = typer.Option(1e-5, help="target δ (below 1/n)"),
    allow_large_delta: bool = typer.Option(False, "--allow-large-delta", help="accept δ ≥ 1/n (not advised)"),
    noise_multiplier: float | None = typer.Option(None, help="use this ν instead of calibrating to ε"),
    epochs: float | None = typer.Option(None, help="epochs (T = epochs/q) [default: 5; 50 at full batch, dpzo]"),
    batch_size: float | None = typer.Option(
        None,
        "--expected-batch-size",
        "--batch-size",
        help="expected batch size L (Poisson rate q = L/n); default min(256, n/10) rounded",
    ),
    full_batch: bool = typer.Option(False, "--full-batch", help="full-batch training (q = 1)"),
    hp: list[str] = typer.Option([], "--hp", help="strategy hyperparameter key=value (repeatable), e.g. --hp lr=0.5"),
    model_opt: list[str] = typer.Option(
        [], "--model-opt", help="option of a built-in --model, key=value (repeatable), e.g. --model-opt mode=lora"
    ),
    accountant: str = typer.Option(
        "auto", help="auto (the tightest: PLD, or exact μ-GDP at full batch), rdp, pld or gdp (full batch only)"
    ),
    eval_every: int = typer.Option(50, help="evaluate on the test split every N steps"),
    seed: int = typer.Option(0),
    data_dir: str | None = typer.Option(None, help="local dataset copies (else $DPTUNE_DATA_DIR / download cache)"),
    device: str | None = typer.Option(
        None,
        help="cpu, cuda, cuda:N or mps (default: cuda if available); a device that is not available here is an error",
    ),
    out: Path = typer.Option(Path("dptune-train.json"), help="where to write the JSON result (the release)"),
    diagnostics_out: Path | None = typer.Option(
        None,
        help="where to write the diagnostics JSON, not differentially private: for the data owner only "
        "(default: diagnostics/<out name> beside --out)",
    ),
    no_progress: bool = typer.Option(
        False, "--no-progress", help="no progress bar (it shows no loss on the private batch)"
    ),
    secure: bool = typer.Option(
        False,
        "--secure-mode",
        "--secure",
        help="secure mode: noise and Poisson batches from the OS CSPRNG, "
        "not from --seed (not reproducible; use it for a model you will publish)",
    ),
    save: Path | None = typer.Option(
        None,
        "--save",
        help="folder for the model (see --checkpoint): model.pt + model_card.json/.md; "
        "reload with dptune.load_model(DIR)",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace --out and diagnostics; use a non-empty --save"),
) -> None:
    """Train one model with differential privacy; write the release JSON (guarantee, configuration,
    evaluations on a public test split, ledger totals) and, apart, the diagnostics JSON (history
    with the training loss and realised batch sizes, metrics on a private test split: not
    differentially private)."""
    _train(SimpleNamespace(**locals()))  # the options, by name


def _train(o: SimpleNamespace) -> None:
    """``dptune train``'s work: every check before any data is read, the run, its files, its table."""
    check_train_options(o)  # first the checks that need neither torch nor the data: an error in < 1 s
    # A built-in dataset's standard test split is public benchmark data; the user's is private unless declared.
    eval_public = o.eval_public or o.data is None
    checkpoint = checkpoint_rule(o.checkpoint, True, eval_public)
    check_data_dir(o.data_dir)
    diag_path = train_output_paths(o.out, o.diagnostics_out, o.save, o.overwrite)
    from dptune.devices import resolve_device  # torch from here on
    from dptune.distributed import world_size, writes
    from dptune.models import for_training
    from dptune.strategies import make_strategy
    from dptune.train import train as run_train

    device = str(resolve_device(o.device, "--device"))
    name = make_strategy(o.strategy, **parse_hyperparameters(o.hp)).name  # still before the data load
    full_batch = o.full_batch or (o.batch_size is None and name == "dpgd")  # DP-GD: full batch by definition
    # measured (docs/performance.md): DP-GD's full batch and DP-ZO's noisy directions need 50 epochs (dpzo at 5: chance)
    epochs = o.epochs if o.epochs is not None else 50.0 if full_batch or name == "dpzo" else 5.0
    options = parse_hyperparameters(o.model_opt, "--model-opt", "mode=lora")
    train_part, test_part, net, model_id = for_training(
        o.data, o.dataset, o.model, o.data_dir, o.seed, dict(label=o.label, test=o.test, schema=o.schema), options
    )
    dataset, model_name = o.data or o.dataset, model_id.get("factory", model_id.get("name"))  # "auto" resolved
    target = None if o.noise_multiplier else o.epsilon
    result = run_train(
        net, train_part, o.strategy, epochs=epochs, expected_batch_size=o.batch_size,
        full_batch=full_batch, noise_multiplier=o.noise_multiplier, target_epsilon=target, delta=o.delta,
        accountant=o.accountant, eval_data=test_part, eval_public=eval_public, checkpoint=checkpoint,
        allow_large_delta=o.allow_large_delta, eval_every=o.eval_every, seed=o.seed, device=device,
        progress=not o.no_progress, secure_mode=o.secure, **parse_hyperparameters(o.hp),
    )  # fmt: skip
    if not writes():  # under torchrun: one run on every process (dptune.distributed), rank 0 writes
        return
    # The seed goes to the diagnostics only, and so do the metrics on a private test split.
    context = dict(dataset=dataset, model=model_name, seed=o.seed, selection_split="test")
    if (ranks := world_size()) > 1:  # the diagnostics' batch sizes and losses are rank 0's shard (found in review)
        context.update(ranks=ranks, ranks_note="the history's batch_size and train_loss are rank 0's shard")
    if o.save is not None:  # the deliverable (post-processing, no release) before the JSON, which marks the run
        from dptune.deliverable import save_trained  # complete (found in review: a crash between lost the model)

        save_trained(result, o.save, model_id=model_id, data_id={"name": dataset})  # not the seed: a secret key
    release = write_train_outputs(result, o.out, diag_path, label_folder=o.diagnostics_out is None, **context)
    rows = [*train_table_rows(result, release, target), ("result", o.out)]
    rows += [("saved model", o.save)] if o.save is not None else []
    nodp = "" if result.plan.strategy.private else f" ({NOT_DP_LABEL}: no privacy)"
    t = Table("quantity", "value", title=f"dptune train: {o.strategy} on {release['dataset']}{nodp}")
    t.columns[1].justify = "right"
    for k, v in rows:
        t.add_row(k, str(v))
    print_table(console, t)
    if not result.secure_mode:  # a known seed voids the guarantee: say so on every seeded run
        console.print(f"[yellow]warning[/]: {release['randomness_note']}", highlight=False)
    # The run time grows with the realised batch sizes: a diagnostic, like the loss.
    held = f"training loss on the private batch, realised batch sizes; {result.seconds:.1f} s"
    console.print(f"[red]diagnostics ({NOT_DP_LABEL})[/]: {diag_path} ({held})", highlight=False)


@app.command()
@_guard
def account(
    noise_multiplier: float = typer.Option(..., help="per-step noise multiplier ν"),
    sampling_rate: float = typer.Option(..., help="Poisson sampling rate q = L/n (1 = full batch)"),
    steps: int = typer.Option(..., help="number of steps T"),
    delta: float = typer.Option(1e-5),
    runs: int = typer.Option(1, help="number of runs composed (per-grid accounting)"),
    accountant: str = typer.Option("all", help="rdp, pld, gdp or all"),
) -> None:
    """ε(δ) of T Poisson-sampled Gaussian steps (× runs)."""
    from dptune import accounting  # not dptune.train: that would import torch for a table of ε
    from dptune.accounting_text import epsilon_rows

    accounting.check_sampling_rate(sampling_rate)
    accounting.check_noise_multiplier(noise_multiplier)  # nan, 0, negative: one clear error
    if steps < 1 or runs < 1:
        raise DPTuneError(f"--steps and --runs must be ≥ 1, got {steps} and {runs}. Fix: e.g. --steps 1000 --runs 1.")
    accounting.check_delta(delta)
    # ν and q exactly as used (not rounded); ε rounded up: it is a privacy claim.
    t = Table(title=f"ν={noise_multiplier!r}, q={sampling_rate!r}, T={steps}, runs={runs}, δ={delta:g}")
    t.add_column("accountant")
    t.add_column("ε", justify="right")
    for row in epsilon_rows(noise_multiplier, sampling_rate, steps, delta, runs, accountant):
        t.add_row(*row)
    print_table(console, t)


@app.command()
@_guard
def calibrate(
    epsilon: float = typer.Option(..., "--target-epsilon", "--epsilon", help="target total ε"),
    delta: float = typer.Option(1e-5),
    sampling_rate: float = typer.Option(..., help="q = L/n (1 = full batch)"),
    steps: int = typer.Option(..., help="steps per run"),
    runs: int = typer.Option(1, help="runs composed (e.g. grid size)"),
    accountant: str = typer.Option("auto", help="auto (PLD, or exact GDP at q = 1), rdp, pld or gdp"),
) -> None:
    """Smallest noise multiplier ν meeting (ε, δ): never overshoots the target."""
    from dptune.accounting_text import calibrated_noise

    text, achieved, accountant = calibrated_noise(epsilon, delta, sampling_rate, steps, runs, accountant)
    console.print(f"ν = [bold]{text}[/]  (ε achieved {achieved:.6g} ≤ {epsilon:g} at δ = {delta:g}, {accountant})")


@app.command()
@_guard
def tune(
    config: Path = typer.Argument(..., help="study file (.toml or .yaml); see docs/tuning.md"),
    out: Path = typer.Option(None, "--out", "-o", help="study directory (default: studies/<study name>)"),
    executor: str = typer.Option("local", help="local, process or ray (an extra: pip install 'dptune\\[ray]')"),
    workers: int | None = typer.Option(None, help="parallel workers (process/ray)"),
    address: str | None = typer.Option(None, "--address", help="Ray cluster address (default: a local Ray)"),
    progress: bool = typer.Option(True, help="show progress bars"),
    gpus_per_run: float | None = typer.Option(
        None, help="Ray only, runs on CUDA: GPUs each run requests (default 1; e.g. 0.25 packs four runs per GPU)"
    ),
) -> None:
    """Plan a whole study inside its budget, run it, print the results table and budget."""
    check_study_options(executor, workers, address, config, is_file=True)  # before torch: an error in < 1 s
    from dptune.tune import load_study_config, run_study
    from dptune.tune.results import load_study, release_note, render

    study = load_study_config(config)
    study_dir = out or Path("studies") / study.name
    # (a lone .lock: another process planning there says so itself, in run_study)
    refuse_foreign_dir(study_dir, ["study.sqlite"], "--out", "or the directory of the study to continue.")
    with resume_hint(study_dir, _say_interrupted):
        outcome = run_study(
            study, study_dir, executor=executor, address=address, progress=progress, workers=workers,
            gpus_per_run=gpus_per_run,
        )  # fmt: skip
    study_dir = outcome.study_dir  # "e/m/.." is stored in e
    render(study_dir, console)
    console.print(f"study directory: {study_dir}  (`dptune report {study_dir}` writes the HTML report)")
    console.print(publish_note(study_dir), highlight=False)
    if whole := release_note(load_study(study_dir)[1]):
        console.print(whole, highlight=False)
    _exit_if_incomplete(study_dir, outcome)


def _exit_if_incomplete(study_dir: Path, outcome: Any) -> None:
    """Runs that did not finish (e.g. a killed worker) are said, with exit code 1: never a silent success."""
    if outcome.complete:
        return
    from dptune.tune.results import load_study

    # Failed-run counts and the first failure's error line are not covered by the guarantee: the owner's view, labelled.
    left = sum(n for s, n in outcome.counts.items() if s not in ("done", "diverged"))
    errors = [r.get("error") for r in load_study(study_dir)[2] if r.get("status") == "failed" and r.get("error")]
    why = escape(f", the first: {str(errors[0]).strip().splitlines()[-1][:200]}") if errors else ""  # a "[/x]"
    d = escape(str(study_dir))
    msg = (
        f"[bold red]{left} of {sum(outcome.counts.values())} runs did not finish "
        f"({outcome.counts.get('failed', 0)} failed{why}; {NOT_DP_LABEL}).[/] "
        f"Check with `dptune status {d}`; `dptune resume {d}` retries them with the same seeds."
    )
    console.print(msg, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@app.command()
@_guard
def status(study_dir: Path = typer.Argument(..., help="a study directory")) -> None:
    """Progress and budget of a (possibly running or interrupted) study (for the data owner:
    run counts are not differentially private)."""
    check_study_path(study_dir)  # before torch loads
    from dptune.tune import study_status

    st = study_status(study_dir)
    # Run counts reveal K under Liu–Talwar / repeat-and-select: the owner's view, labelled.
    console.print(f"[bold red]{NOT_DP_LABEL}[/]", highlight=False)
    counts = ", ".join(f"{k} {v}" for k, v in st.get("counts", {}).items())
    head = f"[bold]{st.get('name', study_dir)}[/]: {st.get('total', '?')} planned runs ({counts})"
    console.print(f"{head}; complete: {st.get('complete')}")
    if not st.get("complete") and st.get("eta"):  # "running" counts only runs a worker has started
        console.print(f"time left: {st['eta']}", highlight=False)
    t = Table(title="per tuning procedure: runs and budget (planned vs spent so far)")
    for col in ("arm", "method", "done/runs", "planned (ε, δ)", "spent (ε, δ)"):
        t.add_column(col, justify="left" if col in ("arm", "method") else "right")
    for a in st.get("arms", []):
        done = f"{a.get('done', 0) + a.get('diverged', 0)}/{a.get('runs', '?')}"  # finished: diverged ones too
        planned = f"({up(a.get('planned_epsilon', float('nan')), 4)}, {up(a.get('planned_delta', float('nan')))})"
        spent = f"({up(a.get('spent_epsilon', 0.0), 4)}, {up(a.get('spent_delta', 0.0))})"
        t.add_row(str(a.get("arm")), str(a.get("method")), done, planned, spent)
    print_table(console, t)
    for k, v in st.items():  # the rest of the status
        if k not in ("arms", "counts", "name", "total", "complete", "eta", "eta_seconds"):
            console.print(f"{k}: {json.dumps(v, default=str) if isinstance(v, dict | list) else v}")


@app.command()
@_guard
def resume(
    study_dir: Path = typer.Argument(..., help="a study directory"),
    executor: str = typer.Option("local", help="local, process or ray (an extra: pip install 'dptune\\[ray]')"),
    workers: int | None = typer.Option(None),
    address: str | None = typer.Option(None, "--address"),
    progress: bool = typer.Option(True),
    gpus_per_run: float | None = typer.Option(None, help="Ray only, runs on CUDA: GPUs each run requests"),
) -> None:
    """Continue an interrupted study: finished runs are kept, interrupted runs re-execute
    with the same seeds and noise streams (nothing is released or spent twice)."""
    check_study_options(executor, workers, address, study_dir, is_file=False)  # before torch loads
    from dptune.tune import resume_study, study_status
    from dptune.tune.executors import check_executor
    from dptune.tune.results import render
    from dptune.tune.study import finish_study

    check_executor(executor, address)  # Ray and its address, even when nothing is left to run
    st = study_status(study_dir)
    if st["complete"]:  # nothing to run: say so rather than print the table as if it had resumed
        # No run count: under Liu–Talwar / repeat-and-select it is not covered by the guarantee.
        done = f"study {st['name']!r} in {study_dir} is already complete: nothing to resume."
        finish_study(study_dir, complete=True)  # its results and models, written again: a kill may have cut them short
        console.print(f"{done} See its results with `dptune report {study_dir}`.", highlight=False, soft_wrap=True)
        return
    with resume_hint(study_dir, _say_interrupted):
        outcome = resume_study(
            study_dir, executor=executor, address=address, progress=progress, workers=workers, gpus_per_run=gpus_per_run
        )
    render(study_dir, console)
    _exit_if_incomplete(study_dir, outcome)


@app.command()
@_guard
def report(
    study_dir: Path = typer.Argument(..., help="a study directory"),
    out: Path | None = typer.Option(None, help="output folder, gets release/ and diagnostics/ (default: study_dir)"),
    include_diagnostics: bool = typer.Option(
        False,
        "--include-diagnostics",
        help="also write diagnostics/report.html: every run, per-run ledger, training loss and batch sizes, "
        "under a banner (not differentially private: for the data owner only)",
    ),
) -> None:
    """Write CSVs, figures and a self-contained HTML report of a study: release/ (publishable:
    covered by the guarantee) and diagnostics/ (not differentially private)."""
    check_study_path(study_dir)  # before torch loads
    from dptune.report import report_study
    from dptune.tune.export import export_study
    from dptune.tune.results import render, study_status, write_csvs

    mark_out = _claim_out(study_dir, out)  # before anything is printed or written
    render(study_dir, console, diagnostics=include_diagnostics)
    write_csvs(study_dir)
    mark_out()
    html = report_study(study_dir, out, include_diagnostics=include_diagnostics)
    console.print(f"report: {html}")
    if study_status(study_dir)["complete"]:  # the selected models + cards (no retraining, no release)
        for d in export_study(study_dir, out=out, skip_missing=True):
            console.print(f"model: {d}")
    else:  # said here, not only inside the HTML (no run count: K may be secret)
        msg = f"the study is unfinished: this report shows its finished runs; `dptune resume {study_dir}` finishes it."
        console.print(f"[bold yellow]warning[/]: {escape(msg)}", highlight=False, soft_wrap=True)
    diag = html.parent.parent / DIAGNOSTICS_DIR
    page = f" (page: {diag / 'report.html'})" if include_diagnostics else ""
    console.print(f"[red]diagnostics ({NOT_DP_LABEL})[/]: {diag}{page}", highlight=False)


def _claim_out(study_dir: Path, out: Path | None) -> Any:
    """report/export --out: new, empty or this study's (.dptune-study): an audit saw another study's models replaced.
    Returns the call that marks it as this study's, made once the study was read (a refusal leaves no folder)."""
    check_output_dir(out, "--out")  # a file there was a NotADirectoryError traceback
    refuse_inside_release(out or study_dir, "--out")
    if out is None or (me := f"{study_dir.resolve()}\n") == f"{out.resolve()}\n":
        return lambda: None
    if not (mark := out / ".dptune-study").is_file() or mark.read_text(encoding="utf-8") != me:
        refuse_foreign_dir(out, [], "--out", f"or the --out of an earlier report or export of {str(study_dir)!r}.")
    return lambda: (release_dir(out).parent / mark.name).write_text(me, encoding="utf-8")  # out/ made, with release/


@app.command()
@_guard
def export(
    study_dir: Path = typer.Argument(..., help="a finished study directory"),
    arm: str | None = typer.Option(None, "--arm", help="the arm to export (default: every arm), e.g. 'dpsgd@eps=1'"),
    out: Path | None = typer.Option(None, help="output folder, gets release/models/<arm>/ (default: study_dir)"),
) -> None:
    """Write the selected model of a finished study with its model card (model.pt, model_card.json,
    model_card.md) into release/models/<arm>/, from the stored checkpoint: no retraining, so no new
    release. Reload it with dptune.load_model(DIR)."""
    check_study_path(study_dir)  # before torch loads
    from dptune.tune.export import export_study

    mark_out = _claim_out(study_dir, out)
    for d in export_study(study_dir, arm, out):
        console.print(f"model: {d}  (dptune.load_model({str(d)!r}))", highlight=False)
    mark_out()


@app.command()
@_guard
def reproduce(
    name: str = typer.Argument(..., help="preset name; `dptune reproduce list` lists them"),
    scale: str = typer.Option("smoke", help="smoke, small or paper (galli-mnist also: gpu-slice)"),
    out: Path | None = typer.Option(None, help="output directory (default: runs/<name>-<scale>)"),
    data_dir: str | None = typer.Option(None, help="datasets folder (else $DPTUNE_DATA_DIR, else download)"),
    executor: str = typer.Option("local", help="local, process or ray (an extra: pip install 'dptune\\[ray]')"),
    workers: int | None = typer.Option(None),
    device: str | None = typer.Option(None),
    k: int | None = typer.Option(
        None,
        help="grid granularity for the Galli presets: 5, 7 or 9 at --scale paper "
        "(default 7) and gpu-slice (default 5); 1 to 9 at smoke and small (default 2, 3)",
    ),
    steps: int | None = typer.Option(
        None, help="Galli presets: train every run this many steps (a quick check; not comparable with the paper)"
    ),
    limit: int | None = typer.Option(None, help="Galli presets: use this many training examples (a quick check)"),
    average: str | None = typer.Option(
        None,
        help="Panda presets: add the iterate-averaging ablation, a second grid oracle whose DP-GD returns the "
        "ema or swa of its iterates (Panda Fig. 11)",
    ),
    progress: bool = typer.Option(True),
) -> None:
    """Reproduce a paper experiment (Galli, Mohapatra, Panda) at a given scale."""
    from dptune import presets

    if name in ("list", "--list"):
        print_table(console, presets.presets_table())
        return
    opts = {key: v for key, v in {"k": k, "steps": steps, "limit": limit, "average": average}.items() if v is not None}
    if steps is not None and steps >= 1:  # planned only after the output folder is made: refused here first
        from dptune.release.sampling import check_steps

        check_steps(steps, f"--steps {steps}")
    out_dir = out or Path("runs") / f"{name}-{scale}"
    check_output_dir(out_dir, "--out")  # below a file: a NotADirectoryError traceback
    if device is not None:  # '' was read as "not given"
        from dptune.devices import check_device_name

        check_device_name(device, "--device")
    check_data_dir(data_dir)
    presets.reproduce(
        name, scale, out_dir, data_dir=data_dir, executor=executor, progress=progress, workers=workers,
        device=device, console=console, **opts,
    )  # fmt: skip


@app.command()
@_guard
def demo(
    out: Path = typer.Option(Path("dptune-demo"), help="study directory of the demo"),
    progress: bool = typer.Option(True),
) -> None:
    """The main job: an honest study on embedded MNIST (5k) comparing online / dpsgd /
    quantile / adamwosm at two ε values; prints the table and writes the HTML report."""
    from dptune import presets

    check_output_dir(out, "--out")  # below a file: a NotADirectoryError traceback
    presets.demo(out, progress=progress, console=console)


@app.command()
@_guard
def audit(
    strategy: str = typer.Option(..., help="dpsgd, quantile, oso, adamwosm, adadp, dpgd or grid"),
    eps: float = typer.Option(4.0, help="the claimed ε to audit"),
    delta: float = typer.Option(1e-5),
    method: str = typer.Option("one-run", help="one-run (Steinke et al. 2023) or two-world (Jagielski et al. 2020)"),
    seed: int = typer.Option(0),
    canaries: int | None = typer.Option(None, help="m canaries (one-run) or trials per world (two-world)"),
    threat_model: str = typer.Option("white-box", help="white-box (released sums) or black-box (final model)"),
    confidence: float = typer.Option(0.95, help="confidence of the lower bound"),
    out: Path | None = typer.Option(None, help="write the result as JSON here"),
) -> None:
    """Empirical privacy audit: an ε lower bound (95% confidence) for the claimed ε.
    Exit code 1 when the audit refutes the claim."""
    from dptune.audit import run_audit

    if out is not None:  # a bad path once failed after the audit, losing its result
        check_output_file(out, "--out")
    res = run_audit(
        strategy, eps, delta, method=method, seed=seed, canaries=canaries, threat_model=threat_model,
        confidence=confidence, on_progress=lambda msg: err_console.print(f"[dim]{msg}[/]", highlight=False),
    )  # fmt: skip
    console.print(res.summary())
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(strict_json(res.to_dict(), indent=2))
    if res.flagged:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # `python -m dptune.cli` (torchrun -m): found in review doing nothing
    main()
