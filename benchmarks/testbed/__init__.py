"""A multi-host testbed on one machine: network namespaces as hosts, rate-shaped veth links through a
bridge namespace, every hybridrec service started with `hybridrec serve` inside its host.

    python -m benchmarks.testbed run examples/criteo_synth.yaml --rate 1gbit
    python -m benchmarks.testbed cleanup

See docs/testbed.md.
"""
