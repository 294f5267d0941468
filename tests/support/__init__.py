"""What the tests share: fakes, real daemons as processes, and the fuzz world and cases.

tests/support/fakes.py       FakeClock and small aggregator fixtures
tests/support/processes.py   the repository root, tiny learner flags, server and learner
                             processes (through deploy/launcher.py), their logs
tests/support/titan_island.py  a tiny torchtitan llama trained by DilocoTrainer on the CPU
                             (torchrun; tests/integration/test_torchtitan.py)
tests/support/fuzz/          the in-process fuzz world, strategies, cases, the loopback
                             gRPC caller and the decoder cases (also run by bench/fuzz.py)
"""
