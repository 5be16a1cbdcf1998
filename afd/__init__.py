"""afd: a serving engine for MoE LLMs with Attention-FFN Disaggregation."""

__version__ = "0.1.0"
