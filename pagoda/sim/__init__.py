"""`pagoda sim`: how a fleet of replicas behaves, in simulated time, with pagoda's own
parts in the loop so the simulation and the product never drift apart: each replica
runs the real `Scheduler` and `KVCacheManager` (prefix cache, chunked prefill,
preemption, optionally a disk tier, its own or shared, stood in for by an index) with
a stand-in model whose step takes what a cost model fitted on this machine says
(`pagoda bench profile`); the router's real policy code routes, fed the
replicas' KV events; arrivals, autoscaling and failures are events in one queue.

    cost_model.py  StepShape (what a step computes), StepCostModel (fit, JSON)
    workloads.py   requests: uniform, shared-prefix, sessions; Poisson, gamma, day; traces
    replica.py     SimReplica: a scheduler and its KV cache, stepping
    tier.py        SimTier: the disk KV tier's interface, an index under a byte budget
    simulator.py   FleetSpec, Simulation: the event loop and its results
    cli.py         the command, its table, JSON and plot
"""
