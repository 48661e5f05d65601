"""The cost of running a forward of yours one example at a time (docs/privacy.md, item 21), side by side in one
run: ``dptune.train`` step time on a user-defined MLP and CNN with 'auto' (vmap: your forward) and with the
class declaring ``dptune_rowwise = True`` (the ghost path). CPU, 1 thread, batch 256, best of 3 alternated rounds.

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


def run(cls, declared, x, y, steps=30):
    model = (type("Declared", (cls,), {"dptune_rowwise": True}) if declared else cls)()
    t = time.perf_counter()
    dptune.train(model, (x, y), "dpsgd", steps=steps, expected_batch_size=256, noise_multiplier=1.0, delta=1e-5, seed=0)
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the run-length and vmap warnings
    torch.manual_seed(0)
    for name, cls, x in [("MLP", MLP, torch.randn(4096, 784)), ("CNN", CNN, torch.randn(4096, 1, 28, 28))]:
        y = torch.randint(0, 10, (4096,))
        res: dict[bool, list[float]] = {d: [] for d in (False, True)}
        for _ in range(3):  # alternated: the two paths see the same machine state
            for d in (False, True):
                res[d].append(run(cls, d, x, y))
        own, declared = min(res[False]), min(res[True])
        print(
            f"{name}: your forward (vmap) {own:.1f} ms/step; declared row-wise (ghost) {declared:.1f}; {own / declared:.2f}x"
        )


if __name__ == "__main__":
    main()
