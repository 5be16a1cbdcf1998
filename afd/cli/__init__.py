"""Command line: ``afd generate``, ``afd bench ...``."""
