"""The cost of computing a forward of yours one example at a time (docs/privacy.md, item 21), side by side in one
run: ``dptune.train`` step time on a user-defined MLP and CNN on the vmap path (per-example gradients), with
'auto' (the ghost path under vmap: each example alone) and with the class declaring ``dptune_rowwise = True``
(the batched ghost path). CPU, 1 thread, batch 256, best of 3 alternated rounds.

    python benchmarks/trusted_forward.py
"""

import time
import warnings

import torch
from torch import nn

import dptune


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(784, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.flatten(1))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.fc = nn.Conv2d(1, 16, 8, 2, 3), nn.Conv2d(16, 32, 4, 2), nn.Linear(32 * 16, 10)

    def forward(self, x):
        h = torch.max_pool2d(torch.tanh(self.c1(x)), 2, 1)
        h = torch.max_pool2d(torch.tanh(self.c2(h)), 2, 1)
        return self.fc(h.flatten(1))


PATHS = {"vmap": (False, "vmap"), "ghost under vmap": (False, "auto"), "declared (batched ghost)": (True, "auto")}


def run(cls, path, x, y, steps=30):
    declared, method = PATHS[path]
    model = (type("Declared", (cls,), {"dptune_rowwise": True}) if declared else cls)()
    t = time.perf_counter()
    dptune.train(
        model, (x, y), "dpsgd", steps=steps, expected_batch_size=256, noise_multiplier=1.0, delta=1e-5, seed=0,
        grad_method=method,
    )  # fmt: skip
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the run-length and vmap warnings
    torch.manual_seed(0)
    for name, cls, x in [("MLP", MLP, torch.randn(4096, 784)), ("CNN", CNN, torch.randn(4096, 1, 28, 28))]:
        y = torch.randint(0, 10, (4096,))
        res: dict[str, list[float]] = {p: [] for p in PATHS}
        for _ in range(3):  # alternated: the paths see the same machine state
            for p in PATHS:
                res[p].append(run(cls, p, x, y))
        print(f"{name}: " + "; ".join(f"{p} {min(t):.1f} ms/step" for p, t in res.items()))


if __name__ == "__main__":
    main()
