"""What the `inflight` commands do (argparse stays in `worker/__main__.py`): the client commands, `inflight check` (preflight) and topic creation."""
