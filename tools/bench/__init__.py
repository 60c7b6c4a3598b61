"""The benchmarks, each `python -m tools.bench.<name>` (docs/benchmarks.md), over one shared
harness (`harness.py`: checkpoints and sizes per device, the result header, percentiles, a
worker process); workloads (`workloads.py`), connection flags (`connections.py`) and the
vLLM peer (`vllm_peer.py`) beside them."""
