"""What the cancel index costs (worker/serve/cancels.py): a worker reads the cancel topic
from its log start before it takes a job, and keeps every cancelled job id in memory.

Produces --cancels cancel records (UUID job ids, as `InflightClient.cancel` sends them)
to a fresh prefix's cancel topic on the dev stack's Kafka, then starts a CancelListener
and times it until it has caught up with the end offsets: replay seconds, cancels/s, and
the memory the index holds (the dict and its id strings, bytes per id). Writes
bench_cancels.json under --out (results/).

    tools/stack/devstack.sh up && python -m tools.bench.cancels --cancels 200000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path


async def produce(bootstrap: str, topic: str, n: int) -> float:
    from aiokafka import AIOKafkaProducer

    from schemas.codec import encode
    from schemas.wire import Cancel

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=1 << 20)
    await producer.start()
    t0 = time.perf_counter()
    try:
        futs = []
        for _ in range(n):
            jid = str(uuid.uuid4())
            futs.append(await producer.send(topic, encode(Cancel(job_id=jid)), key=jid.encode()))
            if len(futs) >= 5000:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
    finally:
        await producer.stop()
    return time.perf_counter() - t0


async def replay(bootstrap: str, prefix: str) -> dict:
    from aiokafka import AIOKafkaProducer

    from worker.config import KafkaConfig
    from worker.serve.cancels import CancelListener

    async def noop(job_id: str) -> None:
        return None

    cfg = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
    meta = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await meta.start()
    listener = CancelListener(cfg, "bench", noop, meta.partitions_for)
    try:
        await listener.start()
        stopping = asyncio.Event()
        task = asyncio.create_task(listener.run(stopping))
        async with asyncio.timeout(600):
            await listener.caught_up.wait()
        stopping.set()
        await task
    finally:
        await listener.stop()
        await meta.stop()
    index = listener._index
    index_bytes = sys.getsizeof(index) + sum(sys.getsizeof(k) for k in index)
    return {"replay_s": round(listener.replay_s, 3), "cancels": listener.num_cancels, "ids": len(index),
            "cancels_per_s": round(listener.num_cancels / listener.replay_s),
            "index_mib": round(index_bytes / 2**20, 1), "bytes_per_id": round(index_bytes / max(1, len(index)))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", default="127.0.0.1:19092")
    p.add_argument("--cancels", type=int, default=200_000)
    p.add_argument("--out", default="results")
    a = p.parse_args()
    from schemas import keys
    from worker.cli.topics import create_topics

    prefix = f"benchcancel{uuid.uuid4().hex[:8]}"
    asyncio.run(create_topics(a.bootstrap, prefix, partitions=6))
    produce_s = asyncio.run(produce(a.bootstrap, keys.cancel_topic(prefix), a.cancels))
    result = asyncio.run(replay(a.bootstrap, prefix))
    header = {"command": " ".join(sys.argv), "platform": platform.platform(), "cpu_count": os.cpu_count()}
    report = {"header": header, "produced": a.cancels, "produce_s": round(produce_s, 2), **result}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cancels.json").write_text(json.dumps(report, indent=2))
    print(f"{result['cancels']} cancels replayed in {result['replay_s']} s ({result['cancels_per_s']}/s); "
          f"index {result['index_mib']} MiB ({result['bytes_per_id']} B per id); wrote {out / 'bench_cancels.json'}")


if __name__ == "__main__":
    main()
