"""Data tools of `hybridrec data`: synthetic data sets drawn from a planted model (synth: Criteo TSV;
synth_parquet: the multi-task Parquet set; synth_set: the one `data synth` writes, its options checked), TSV
converted to Parquet (parquet_data), and data files replayed as a timed event stream on NATS (replay)."""
