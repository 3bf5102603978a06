"""The core library: what every service and the app share, importing neither.

Four rooms and the config, each a package whose `__init__` says what it holds:

- `wire`: the data plane's bytes (frames, their codec and compression, jagged batches, ID layout and sharding,
  deduplication, Arrow IPC from a stream, the generated protobuf messages);
- `model`: the model API and its math (models, pooling and its compiled kernels, tasks, eval metrics, bundle
  table lookups);
- `layouts`: what is written to files and read back by another process (bundles, live versions, checkpoints,
  the run summary, the event stream, shared-memory slots, the Criteo format);
- `runtime`: what every process runs on (gRPC plumbing, the service skeleton, logging, metrics, the kernel
  cache, torch imported lazily);
- `config`: the job's typed configuration and the inference service's settings.

The layers are folders: hybridrec/core <- services/NAME <- hybridrec/app (tests/unit/test_layering.py).
"""
