"""Topology and expert placement (pure), process groups and rendezvous."""
