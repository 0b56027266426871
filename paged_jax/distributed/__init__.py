"""Several devices or processes: tensor parallelism over a JAX mesh, and multi-host runs where
process 0 schedules and broadcasts each step."""
