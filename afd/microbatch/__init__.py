"""Micro-batch planner and ping-pong schedule (pure Python)."""

from afd.microbatch.planner import CostModel, MicrobatchPlan, Span, choose_microbatches, choose_plan, plan_microbatches, simulate_step
from afd.microbatch.schedule import Action, Step, ping_pong

__all__ = ["Action", "CostModel", "MicrobatchPlan", "Span", "Step", "choose_microbatches", "choose_plan", "ping_pong", "plan_microbatches", "simulate_step"]
