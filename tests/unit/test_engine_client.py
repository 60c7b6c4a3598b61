"""Both engine clients implement `EngineClient` (worker/engine/core_client.py): every
attribute and method of the protocol, with the protocol's parameters, so the worker
holds either through the one interface."""

from __future__ import annotations

import inspect

from worker.config import EngineConfig, ServingTuning
from worker.engine.core_client import EngineClient, ProcessEngineClient, ThreadEngineClient
from worker.model.null_runner import null_engine


def members(proto) -> tuple[set[str], dict[str, inspect.Signature]]:
    attrs = set(proto.__annotations__)
    methods = {name: inspect.signature(fn) for name, fn in vars(proto).items()
               if callable(fn) and not name.startswith("_")}
    methods.update({name: None for name, v in vars(proto).items() if isinstance(v, property)})
    return attrs, methods


def test_both_engine_clients_implement_the_protocol():
    attrs, methods = members(EngineClient)
    assert {"input", "tuning", "num_steps", "last_tick"} <= attrs and {"start", "submit", "abort", "stop"} <= set(methods)
    clients = [ThreadEngineClient(null_engine(EngineConfig(serving_tuning=ServingTuning()), vocab_size=100)),
               ProcessEngineClient(None, ServingTuning())]
    for client in clients:
        missing = sorted(a for a in attrs | set(methods) if not hasattr(client, a))
        assert not missing, (type(client).__name__, missing)
        for name, sig in methods.items():
            if sig is not None:
                got = list(inspect.signature(getattr(type(client), name)).parameters)
                assert got == list(sig.parameters), (type(client).__name__, name, got)
