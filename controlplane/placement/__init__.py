"""Placement: the routing hint for a turn: which nodes, which path (the planner's cost rule),
and which prefill nodes already cache the prefix."""
