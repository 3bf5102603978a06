"""The app layer: the `hybridrec` command and what only it runs, in sub-packages by what they do.

hybridrec/core/ (the core library) <- services/ (each imports only the core) <- hybridrec/app/ (this package):
cli (the command, a module per command group), run (preflight, the local launcher, the fork servers, progress,
the local broker), report (the run report and summary table), data (synthetic data, TSV-to-Parquet, replay),
plan (the layout fitted to the host, the job's plan, the PS's memory plan) and model (export, offline
prediction). Only this package imports services, and it does so with plain import statements;
tests/unit/test_layering.py checks the graph.
"""
