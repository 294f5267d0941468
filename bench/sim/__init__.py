"""Planning simulator: compute utilisation and goodput of DiLoCo-family training in virtual
time, driven by the project's own fragment layout, schedule and aggregation policy.

    python -m bench.sim.cli all      # Table 4 + goodput curve -> bench/results/sim.json, PNGs
    python -m bench.sim.cli --help

Modules: engine (virtual clock, event queue, FIFO link), model (synthetic transformer,
fragments, wire bytes), throughput (per-layer utilisation model, bandwidth bisection),
goodput (chip failures: elastic DP vs quorum learners on the real Aggregator), paper (the
papers' published figures), reproduce, report, cli.

Modelling assumptions, in short (each module's docstring and bench/sim/README.md give the
full list): replicas identical and in lockstep; forward 1/3 and backward 2/3 of a step,
split evenly over blocks; a stage's gradient is sent when its backward is done and must be
back before the forward that needs it; one FIFO link per island with bandwidth and
latency; ring all-reduce moves 2(K−1)/K of the payload; bytes from common.codec (fp4 =
4.25 bits/value); Poisson chip failures, a fixed recovery time per failed unit; goodput
counts only work that reaches the global model.
"""
