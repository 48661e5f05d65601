"""Cost of the isolation probe (docs/privacy.md, "The isolation probe"; docs/performance.md).

    python benchmarks/isolation_probe_cost.py [rounds]      # ~2 minutes on 2 cores

For each model (batch 512, ghost path, one thread, CPU clock), one ``Strategy.step`` as
``step_throughput.py`` times it, with an oracle that never re-probes ("plain") and one whose
probe is due at every call ("probed"). The probe runs once per ``GradientOracle.PROBE_EVERY``
calls, so its share of a run's time is (probed − plain) / plain / PROBE_EVERY (DP-ZO calls
``losses`` twice per step: both calls are probed here, and the formula still holds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_throughput as st  # noqa: E402
from common import batch_for, build_model, interleaved_medians  # noqa: E402

from dptune.gradients.oracle import GradientOracle  # noqa: E402


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    every = GradientOracle.PROBE_EVERY
    for name, strategies in (("mlp", ["dpsgd", "dpzo"]), ("galli_cnn", ["dpsgd"])):
        model = build_model(name)
        x, y, loss = batch_for(name, 512)
        fns = {}
        for strategy in strategies:
            for probed in (False, True):
                step, oracle = st.dptune_step(model, x, y, loss, strategy, "ghost")  # first probe: untimed

                def run(step=step, oracle=oracle, probed=probed) -> None:
                    due = 1 if probed else 10**9  # passed, and due again at this call (or never: the random gaps)
                    oracle._next_probe = {"grads": due, "losses": due}
                    step()

                fns[f"{strategy}/{'probed' if probed else 'plain'}"] = run
        med = interleaved_medians(fns, rounds=rounds, warmup=1, min_seconds=0.5, clock="cpu", sync=lambda: None)
        for strategy in strategies:
            p, q = med[f"{strategy}/plain"], med[f"{strategy}/probed"]
            print(
                f"{name} {strategy}: plain {1e3 * p:.1f} ms, probed {1e3 * q:.1f} ms (+{100 * (q - p) / p:.0f}%), "
                f"one probe per {every} calls: +{100 * (q - p) / p / every:.1f}% of the run's step time"
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
