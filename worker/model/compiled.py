"""The model's forward under `torch.compile`, with paged attention as one opaque custom op.

transformers' modules (embeddings, norms, projections, RoPE, MLP, the LM head) are traced
by Dynamo and compiled by Inductor; each attention call is `torch.ops.inflight.attention`
(`worker.model.attention.attention_op`, a `torch.library.custom_op`), which Dynamo keeps
as a single node of the graph without tracing into it, so the graph has no break at
attention and the op runs the same back end (`worker.model.kernels`) as the eager
forward: the split vLLM makes for its piecewise graphs (its `unified_attention` op), here
one graph around opaque ops.

The op's inputs are only tensors and constants: what varies per step (block tables,
slots, the decode groups, the KV cache tensors) is the step's `AttentionMetadata`, which
the op reads from `worker.model.attention.current_metadata()` when it runs, so nothing
that changes between steps is a graph input Dynamo would guard on. The attention module
itself (its latent or ALiBi attachments) is found by a key the op is given
(`module.inflight_op_key`), an entry of a table of weak references.

The token dimension (and the number of logit rows kept) is dynamic and unbacked
(`mark_unbacked` on every call, `ModelRunner._execute`): Dynamo may not specialize on
its value, not even on 0 or 1 as it does for plain dynamic sizes, so one graph serves
every step, a decode of one request as well as a 2048-token prefill, and a warmed-up
model never compiles again while it serves (the equivalence tests count the graphs).

Not compiled (the eager forward is used, with one log line naming the reason): a model
with LoRA adapters (their forward hooks change between steps), and any model whose
compiled forward fails its warm-up.
"""

from __future__ import annotations

import torch

import worker.model.attention  # noqa: F401  (registers torch.ops.inflight.attention)


class CompiledForward:
    """`model`'s forward compiled by Inductor (dynamic, unbacked token sizes; no CUDA
    graphs yet): call it as the module. Compilation happens at the first call (the
    warm-up, `worker.engine.compile`).

    Once `warm` is set (after a warm-up that built the one graph) the calls skip Dynamo's
    guard checks (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`): they cost
    about 0.6 ms a step on the CPU benchmark model, a check that every parameter is still
    the one traced, which nothing changes while the engine serves (a LoRA model is not
    compiled). A call that would need another graph raises instead of compiling it; the
    runner then goes back to the eager forward (`ModelRunner._execute`). vLLM skips the
    guards the same way, by calling its compiled code directly.

    Inductor's freezing (weights as graph constants, pre-packed for oneDNN) was measured
    no faster with unbacked sizes on the CPU benchmark model and takes longer to compile:
    not used."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._fn = torch.compile(model, dynamic=True, fullgraph=False)
        self.warm = False

    def __call__(self, **kwargs):
        if not self.warm:
            return self._fn(**kwargs)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self._fn(**kwargs)


def mark_token_dims(input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor) -> None:
    """Make a step's sizes unbacked for Dynamo (module docstring): the token dimension of
    `input_ids` and `position_ids` `[1, num_tokens]` and the rows kept, `keep` `[rows]`."""
    from torch._dynamo.decorators import mark_unbacked

    mark_unbacked(input_ids, 1)
    mark_unbacked(position_ids, 1)
    mark_unbacked(keep, 0)
