"""DNS lookups for discovery (dnspython's async resolver, on asyncio or trio).

A name is resolved to node URLs: its A and AAAA records with the configured port, or, for
an SRV name (``_http._tcp.vllm-decode...``), each record's target's A and AAAA records with
the record's port. Nothing is cached here: every lookup asks the server, so a change shows
within one ``--discovery-interval`` plus the records' TTL in any cache on the way.

A lookup never raises: a query that did not answer (timeout, SERVFAIL, REFUSED, no
server) makes the whole answer a failure, since a partial list would drain nodes that are
still there; a name that does not exist (NXDOMAIN) or has no such records is an empty part.
One exception: a name's A query answered and its AAAA query did not (or the reverse), as
from resolvers that refuse or drop AAAA queries: the answer has the family that answered,
and says which did not (``Answer.unknown``): its addresses are kept as they are.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import anyio
import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.resolver
from dns.rdtypes.IN.SRV import SRV

from pd_router.discovery.rules import IPV4, IPV6, Answer, DnsSpec, url

T = TypeVar("T")


class _Failed(Exception):
    """A query that did not answer; its message is the answer's failure."""


class Resolver:
    def __init__(self, server: tuple[str, int] | None = None, timeout: float = 2.0) -> None:
        """``server``: (IP, port) to ask; None reads the system's configuration
        (/etc/resolv.conf: servers, search domains, so that a short Service name resolves
        in its namespace). Raises ValueError when there is none to read."""
        if server is None:
            try:
                resolver = dns.asyncresolver.Resolver()
            except dns.resolver.NoResolverConfiguration as exc:
                raise ValueError(
                    f"cannot read the system's resolver configuration ({exc}); "
                    "pass --dns-server HOST:PORT"
                ) from None
        else:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [dns.nameserver.Do53Nameserver(*server)]
        resolver.lifetime = timeout
        self._resolver = resolver

    async def lookup(self, spec: DnsSpec) -> Answer:
        try:
            # An SRV name has no port of its own (parse_dns_spec): its records give them.
            unknown: dict[str, str] = {}
            if spec.port is None:
                found = await self._srv(spec.name, unknown)
            else:
                addresses = await self._addresses(spec.name, unknown)
                found = {url(address, spec.port) for address in addresses}
        except _Failed as exc:
            return Answer(failure=str(exc))
        return Answer(frozenset(found), unknown=frozenset(unknown), partial=_first(unknown))

    async def _srv(self, name: str, unknown: dict[str, str]) -> set[str]:
        records = [r for r in await self._query(name, "SRV") if isinstance(r, SRV)]
        # A target of "." says the service is not there (RFC 2782); port 0 is no port an
        # engine listens on: either record is skipped, never the whole answer.
        targets = [(r.target, r.port) for r in records if r.target != dns.name.root and r.port]
        addresses = await _all(self._addresses(target, unknown) for target, _ in targets)
        return {url(a, port) for (_, port), found in zip(targets, addresses) for a in found}

    async def _addresses(self, name: str | dns.name.Name, unknown: dict[str, str]) -> list[str]:
        """The name's addresses; a family whose query failed while the other's answered
        goes in ``unknown`` (family -> why), with no address of it."""
        families = {"A": IPV4, "AAAA": IPV6}
        answered: list[str] = []
        failures: list[_Failed] = []

        async def query(rdtype: str) -> None:
            try:
                answered.extend(str(record) for record in await self._query(name, rdtype))
            except _Failed as exc:
                unknown.setdefault(families[rdtype], str(exc))
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            for rdtype in families:
                tg.start_soon(query, rdtype)
        if len(failures) == len(families):
            raise failures[0]
        return answered

    async def _query(self, name: str | dns.name.Name, rdtype: str) -> list[Any]:
        try:
            answer = await self._resolver.resolve(
                name,
                rdtype,
                search=True,
                raise_on_no_answer=False,
                # dnspython remembers the first event loop library it saw, process-wide;
                # the current one is asked for each time (asyncio under uvicorn, or trio).
                backend=dns.asyncbackend.get_backend(dns.asyncbackend.sniff()),
            )
        except dns.resolver.NXDOMAIN:
            return []
        except dns.resolver.LifetimeTimeout:
            raise _Failed(
                f"{rdtype} {name}: no answer within {self._resolver.lifetime:g} s"
            ) from None
        except dns.resolver.NoNameservers as exc:
            # SERVFAIL, REFUSED...: dnspython's message names the server and the code.
            raise _Failed(f"{rdtype} {name}: {exc}") from None
        except dns.exception.DNSException as exc:
            raise _Failed(f"{rdtype} {name}: {type(exc).__name__}: {exc}") from None
        return list(answer.rrset or ())


def _first(unknown: dict[str, str]) -> str | None:
    return next(iter(unknown.values()), None)


async def _all(work: Iterable[Coroutine[Any, Any, list[T]]]) -> list[list[T]]:
    """Run concurrently; every result in order, or the first ``_Failed`` once all ended
    (raised from a task group it would come wrapped in an exception group)."""
    results: list[list[T]] = []
    failures: list[_Failed] = []

    async def run(index: int, coroutine: Coroutine[Any, Any, list[T]]) -> None:
        try:
            results[index] = await coroutine
        except _Failed as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        for index, coroutine in enumerate(work):
            results.append([])
            tg.start_soon(run, index, coroutine)
    if failures:
        raise failures[0]
    return results
