"""Model side of the engine: loading, paged attention, the model runner, sampling, detokenization."""
