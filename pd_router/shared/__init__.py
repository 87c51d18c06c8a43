"""The pool and the fleet shared on Redis (``--state``): a small Redis client (``redis``,
over ``resp``), the shared pool's I/O (``pool``) around its decisions run as Lua
(``scripts``), the shared fleet (``fleet``) and abort by request id across routers
(``abort``).

May import: ``pd_router.errors`` and ``pd_router.fleet``, whose interfaces it implements.
"""
