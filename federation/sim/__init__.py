"""A discrete-event simulator that replays traces over described topologies.

It drives the real placement framework, the coordinator's negotiation rules and its task state
machine with simulated sites, a simulated clock, and simulated transfers and runs.
"""
