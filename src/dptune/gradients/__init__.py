"""Per-example gradients: the only code that computes them. ``oracle.GradientOracle`` picks a
path (``persample``: torch.func vmap, or hooks; ``ghost``: norms without per-example gradients)
and runs the isolation probe; ``norm_bounds`` makes every norm an upper bound."""
