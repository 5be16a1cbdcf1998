"""Micro-batch planner and ping-pong schedule (pure Python)."""

from afd.pipeline.planner import CostModel, MicrobatchPlan, Span, plan_microbatches
from afd.pipeline.schedule import Action, Step, ping_pong

__all__ = ["Action", "CostModel", "MicrobatchPlan", "Span", "Step", "ping_pong", "plan_microbatches"]
