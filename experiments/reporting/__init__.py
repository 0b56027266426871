"""Shared code of the results files, the results table (docs/results.md) and the plots."""
