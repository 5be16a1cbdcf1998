"""Observability: runtime traces (Chrome/Perfetto JSON) and their timeline picture."""
