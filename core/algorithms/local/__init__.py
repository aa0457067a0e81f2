"""LocalRL: the embedded single-machine RL engine (inference server + policy-gradient trainer)."""
