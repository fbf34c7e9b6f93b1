"""The pre-registered confirmatory study (docs/results/study/PLAN.md): its power calculation, its run
and its planned analysis.

    python benchmarks/study.py power --plan docs/results/study/plan.json --runs RUN... --out power.json
    python benchmarks/study.py run --plan docs/results/study/plan.json --work runs/study \
        --out docs/results/study --jobs 2
    python benchmarks/study.py analyse --plan docs/results/study/plan.json --run runs/study \
        --out docs/results/study

``run`` drives the bench runner over exactly the plan's cells (its cell cache resumes an interrupted
run), then writes summary.json, claims.md and results.csv. The logic is :mod:`fedweigh.bench.study`.
"""

from __future__ import annotations

import sys

from fedweigh.kernels import pin_cpu_kernels

pin_cpu_kernels()  # before this process computes anything: cells run in it use the bench's pinned kernels

from fedweigh.bench.study import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
