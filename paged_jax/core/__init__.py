"""The engine's host bookkeeping in pure Python (no jax, no numpy): block pool and block manager,
scheduler and its SchedulerOutput, sequences, sampling parameters, outputs and beam-search state.
Everything here can be read and tested without a device."""
