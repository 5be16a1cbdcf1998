"""The FFN role: a loop driven by protocol messages over the routed experts this rank holds."""
