"""The driver of test_ray_cluster.py: ``python ray_cluster_driver.py ADDRESS STUDY_DIR run|resume``.

``run`` waits until the cluster has both nodes, then runs the study on it; ``resume`` resumes it
(failed runs retried). Prints the outcome's counts as JSON."""

from __future__ import annotations

import json
import sys
import time

import ray
from test_ray_cluster import study

from dptune.tune import resume_study, run_study

address, study_dir, mode = sys.argv[1:4]
ray.init(address=address, include_dashboard=False, log_to_driver=False)
deadline = time.monotonic() + 90
while mode == "run" and sum(n["Alive"] for n in ray.nodes()) < 2:
    if time.monotonic() > deadline:
        sys.exit("the worker node never joined")
    time.sleep(0.5)
if mode == "run":
    out = run_study(study(), study_dir, executor="ray", address=address, progress=False)
else:
    out = resume_study(study_dir, executor="ray", address=address, progress=False, study=study())
print(json.dumps({"counts": out.counts, "complete": out.complete, "ledger": out.ledger_matches_plan}))
