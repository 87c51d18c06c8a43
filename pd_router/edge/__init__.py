"""What clients touch: the HTTP/1.1 protocol and its limits (``protocol``), request bodies
and ids (``validation``), the client side of one exchange (``stream``), and the marks that
keep a request from passing through one router twice (``hops``).

May import: ``pd_router.errors``. Knows nothing of engines, the fleet or shared state:
``relay.py`` is where the client and the engines meet.
"""
