"""The fuzzer of the servicer and the decoders: worlds, hostile-message strategies, cases.

    world.py        a fresh in-process aggregator per case, its state digest, bounded calls
    strategies.py   well-formed pushes with exactly one defect, and the status each must get
    garbage.py      pushes, tensors and other RPCs with random fields
    cases.py        a servicer case and a concurrent case, judged, and their tally
    grpc_caller.py  the same calls through a loopback gRPC server (with or without tokens)
    decoders.py     hostile inputs to the wire decoders

Run short and derandomized by tests/unit/test_fuzz.py and tests/integration/test_fuzz_rpc.py,
long by bench/fuzz.py (`make fuzz`).
"""
