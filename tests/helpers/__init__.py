"""Helpers shared by the tests (references, oracles, the live-server harness); no tests here."""
