"""Engine pods found through DNS: what an answer changes (``rules``, no I/O), the lookups
(``resolver``) and the loop that applies them to the fleet (``loop``).

May import: ``pd_router.errors`` and ``pd_router.fleet``.
"""
