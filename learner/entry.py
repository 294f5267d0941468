"""The learner side's console scripts: diloco-learner and diloco-status.

gRPC's C core reads GRPC_VERBOSITY once, when grpc is first imported, and below ERROR it
prints INFO lines of its own, such as an SSL handshake's failure when a client and a server
disagree on TLS: the scripts already say that in one sentence (learner/connection.py). So
each script sets ERROR, unless the user set a level, before it imports anything that imports
grpc. `python -m learner.main` and `python -m learner.status` keep gRPC's default.
"""

from __future__ import annotations

import os


def learner() -> None:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from learner.main import main

    main()


def status() -> None:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from learner.status import main

    main()
