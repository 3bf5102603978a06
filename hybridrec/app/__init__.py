"""The app layer: the `hybridrec` command and what only it runs.

hybridrec/ (the core library) <- services/ (each imports only the core) <- hybridrec/app/ (this package:
the CLI, the local launcher, progress and reports, synthetic data, export, the memory plan, offline
prediction). Only this package imports services, and it does so with plain import statements;
tests/unit/test_layering.py checks the graph.
"""
