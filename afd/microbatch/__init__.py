"""Micro-batch planner and ping-pong schedule (pure Python)."""

from afd.microbatch.planner import CostModel, MicrobatchPlan, Span, choose_microbatches, plan_microbatches, simulate_step
from afd.microbatch.schedule import Action, Step, ping_pong

__all__ = ["Action", "CostModel", "MicrobatchPlan", "Span", "Step", "choose_microbatches", "ping_pong", "plan_microbatches", "simulate_step"]
