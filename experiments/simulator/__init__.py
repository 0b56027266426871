"""Shared code of the simulator entry points: the model-free runner on a virtual clock and the step-time model."""
