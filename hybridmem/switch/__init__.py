"""The switch core: the phase machine, the steps and their transaction, memory plans and reports.

Nothing here imports an adapter, an engine or the planner: the parts come in through the contracts
(:mod:`hybridmem.contract`), and :class:`hybridmem.ShardingManager` puts them together.
"""
