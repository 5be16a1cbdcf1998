"""Parity rules and the test-suite runner, shared by tests/, tests/e2e and ``afd capture diff``."""
