"""`inflight gateway`: an OpenAI-compatible HTTP front door to the priority topics.

Stateless and model-less (no torch): several run behind a load balancer. Requests become
jobs on the job topics, answers come from the jobs' Redis streams, batches are driven
from a shared file store and the durable results topic.

| module | owns |
|---|---|
| `config.py` | the `gateway` config section (+ `kafka`, `redis`): listen address, keys, limits, timeouts |
| `auth.py` | API keys (SHA-256 digests) → tenant and highest priority; 401 / 403 |
| `errors.py` | OpenAI's error format and statuses; job outcomes → HTTP errors |
| `protocol.py` | request bodies → `GenRequest`: supported, extension, no-op and rejected fields |
| `render.py` | response bodies, SSE chunks, usage, logprobs (token text from an optional tokenizer) |
| `generation.py` | one interactive job: submit, deadline → 429, deltas across restarts, cancel when abandoned |
| `completions.py` | `POST /v1/chat/completions`, `POST /v1/completions` (JSON or SSE) |
| `tokenize.py` | vLLM's server utilities: `POST /tokenize`, `POST /detokenize`, `GET /version` |
| `liveness.py` | pools without a live worker: 503 `no_live_worker` at once, `/readyz` unready |
| `edge.py` | prompts that cannot fit the context: 400 before anything is produced (a lower-bound count) |
| `files.py` | the file store: uploads, output / error files, batch manifests (atomic writes) |
| `batch/lines.py` | batch input lines → jobs (ids derived from batch id + custom_id); outcomes → output lines |
| `batch/state.py` | batch object and manifest; live state in Redis, durable state in the file store; leases |
| `batch/driver.py` | one batch: validate, dispatch, collect outcomes from the results topic, finalize |
| `batch/manager.py` | create / get / list / cancel; adopts batches whose driver is gone |
| `batch/api.py` | the Batch API's HTTP handlers (`/v1/files`, `/v1/batches`) |
| `metrics.py` | the gateway's Prometheus series |
| `context.py` | what the handlers share |
| `app.py` | `Gateway`: routes, middleware, health, lifecycle |
"""
