"""Wire contract of Inflight: every type that crosses a process boundary.

Imports neither torch nor worker code, so producers can install it alone
(`pip install inflight-worker`) and build jobs from any Python program.
"""

from schemas.params import SamplingParams

__all__ = ["SamplingParams"]
