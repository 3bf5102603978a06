"""What every process runs on: gRPC servers, channels and health (`rpc`), the service skeleton (`service`),
structured logging (`log`), Prometheus metrics (`metrics`), the machine's cache of compiled kernels
(`kernel_cache`), and torch imported when first used (`lazy_torch`)."""
