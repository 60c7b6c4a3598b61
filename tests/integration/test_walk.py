"""`tools/walk.py`, the measure of issue 43's job walk: one job through a real worker on
the dev stack, its stops counted per segment (the counting rules: tests/unit/test_walk.py)."""

from __future__ import annotations

import json

from tools.walk import main


def test_a_job_walks_from_the_starter_to_the_engine_and_out_to_its_offset(services, llama_path, tmp_path):
    out = tmp_path / "walk.json"
    assert main(["--model", str(llama_path), "--kafka", services[0], "--redis", services[1], "--out", str(out)]) == 0
    walks = json.loads(out.read_text())
    intake, engine, output = walks["intake"]["walk"], walks["engine"]["walk"], walks["output"]["walk"]
    # the serving side: the starter takes the record and hands the request through the engine's door
    assert intake[0] == "worker/serve/starter.py" and intake[-3:-1] == ["worker/engine/core_client.py",
                                                                          "worker/serve/starter.py"]
    assert "worker/serve/claims.py" in intake and "worker/engine/input_processor.py" in intake
    # the engine side (thread mode: inside `submit`): the core's queue of arrivals
    assert engine[0] == "worker/engine/engine.py" and "worker/engine/arrivals.py" in engine
    # and out: drafted, numbered by the job, published, the offset done
    assert {"worker/serve/local_job.py", "worker/serve/publish.py", "worker/serve/finalize.py"} <= set(output)
    for w in walks.values():
        assert w["returns"] == w["stops"] - w["files"] >= 0
        assert all(a != b for a, b in zip(w["walk"], w["walk"][1:]))  # one stop per stay in a file
    # one object per door: at most three values beside the job anywhere on the way in
    assert walks["intake"]["most_values_beside_the_job"] <= 3 and walks["engine"]["most_values_beside_the_job"] <= 3

