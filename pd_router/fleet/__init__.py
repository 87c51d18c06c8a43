"""The fleet and its decisions, with no I/O: nodes and their health rules (``nodes``),
which models a node serves (``models``), the decode pool (``pool``), which prefill node
(``prefill``), nodes by id with their bindings and removal (``registry``), which nodes are
hung (``stall``), and who may change the fleet (``membership``).

May import: ``pd_router.errors`` only. Every other plane builds on this one; the shared
state (``pd_router.shared``) implements its pool and membership interfaces on Redis.
Tested with no server, under asyncio and trio.
"""
