"""Planning simulator: compute utilisation and goodput of DiLoCo-family training in virtual
time, driven by the project's own fragment layout, schedule and aggregation policy.

    python -m bench.sim.cli table4      # Streaming DiLoCo Table 4, paper vs ours
    python -m bench.sim.cli --help

See bench/sim/README.md for every modelling assumption.
"""
