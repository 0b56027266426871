"""Shared code of the benchmark entry points: seeded workloads, trace replay, kernel timing."""
