"""The data plane's bytes: every frame (`frames`) over its codec (`codec`), wire compression (`compress`), a
batch's jagged sparse features (`jagged`), the layout of a feature ID (`ids`) and the PS shard that owns it
(`sharding`), compiled deduplication (`dedup`), Arrow IPC streams read from untrusted bytes (`arrow_ipc`), and
the protobuf messages generated from protos/ (`proto`)."""
