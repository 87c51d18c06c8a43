"""Where the router's settings come from: command line > environment > config file > default.

Every flag has the same three other spellings, derived from its argparse dest:

* command line ``--queue-timeout 30``;
* environment ``PD_ROUTER_QUEUE_TIMEOUT=30`` (``PD_ROUTER_`` + the dest in capitals);
* TOML file (``--config FILE`` or ``PD_ROUTER_CONFIG``) ``queue_timeout = 30`` (the dest).

Values from the environment and the file go through the flag's own type function, so a bad
value is refused with the same words as on the command line, but naming where it came from.
Unknown keys and unknown ``PD_ROUTER_*`` variables are refused too: a misspelt setting that
is silently ignored is worse than a router that does not start.

One rule for types. An environment variable is text, read as the command line reads it; a
list's items are separated by whitespace. A TOML value has the setting's type: a number for
a flag whose type function is marked ``reads_number`` (a string ``"5"`` is refused, as ``5``
would be for a string setting), a string for any other, true or false for a switch; a list
takes an array, or one item alone as an array of one (``prefill = "http://p0:8100"``).

Plain functions on plain data; the only I/O is reading the config file that was named.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pd_router.discovery.rules import DnsSpec, dns_spec, parse_dns_spec
from pd_router.fleet.nodes import (
    MAX_SLOTS,
    NodeSpec,
    Role,
    check_labels,
    normalise_url,
    parse_spec,
)
from pd_router.parser import suggest

ENV_PREFIX = "PD_ROUTER_"
CONFIG_KEY = "config"
NODE_KEYS = ("prefill", "decode")
NODE_TABLE_KEYS = ("url", "slots", "labels")
# Names to discover nodes by (``discovery/rules.py``): each role's alternative to a node list.
DNS_KEYS = ("prefill_dns", "decode_dns")
DNS_TABLE_KEYS = ("name", "port", "slots", "labels")
# Settings whose value no message repeats: tokens, and a URL that may carry a password.
SECRETS = frozenset({"admin_token", "engine_api_key", "state", "otlp_traces_endpoint"})

# The flags' type functions that read a number (``reads_number``).
_NUMBERS: set[Callable[[str], Any]] = {int, float}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_TYPE_WORDS: dict[Any, str] = {int: "a whole number", float: "a number"}


C = TypeVar("C", bound=Callable[[str], Any])


def number(text: str) -> float:
    """A flag's number, or NaN (which fails every range check) for text that is none or a
    number that is not finite: ``inf`` seconds made the prober's tick NaN."""
    # ASCII, no spaces or digit separators: float() also reads "1_0", " 5" and other
    # scripts' digits.
    if not text.isascii() or "_" in text or text != text.strip():
        return math.nan
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def reads_number(convert: C) -> C:
    """Mark a flag's type function as reading a number: in a TOML file, its value is one."""
    _NUMBERS.add(convert)
    return convert


class ConfigError(ValueError):
    """A setting that cannot be used; the message names its key and where it came from."""


class MissingSettings(ConfigError):
    """A required setting that no source gave."""


@dataclass(frozen=True)
class Option:
    """One flag, as every source spells it."""

    key: str  # the argparse dest; also the config file's key
    flag: str
    convert: Callable[[str], Any]
    default: Any = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # on/off, no value on the command line
    required: bool = False
    many: bool = False  # a list: the flag takes several values, or is given several times

    @property
    def number(self) -> bool:
        return self.convert in _NUMBERS

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def nodes(self) -> bool:
        return self.key in NODE_KEYS

    @property
    def dns(self) -> Role | None:
        """The role of a list of DNS names, else None."""
        return (
            "prefill"
            if self.key == "prefill_dns"
            else "decode" if self.key == "decode_dns" else None
        )


def options_of(actions: Iterable[argparse.Action]) -> dict[str, Option]:
    """The options behind argparse actions, read before anything changes their defaults."""
    options = {}
    for action in actions:
        convert = action.type if callable(action.type) else str
        choices = tuple(action.choices) if action.choices is not None else None
        options[action.dest] = Option(
            key=action.dest,
            flag=action.option_strings[0],
            convert=convert,
            default=action.default,
            choices=choices,
            switch=action.nargs == 0,
            required=action.required,
            many=action.nargs == "+",
        )
    return options


def resolve(
    options: Mapping[str, Option], cli: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, Any]:
    """Every option's value: ``cli`` holds only the flags that were given (argparse-typed).

    Node lists come out as ``list[NodeSpec]`` whichever source they came from; a source's
    list replaces a lower one's, it is not appended to.
    """
    given = from_cli(cli, options)
    env = from_env(environ, options)
    path = given.get(CONFIG_KEY, env.get(CONFIG_KEY))
    file = from_file(read_file(path), options, source=path) if path else {}
    values = merge(options, given, env, file)
    # A required node list may be replaced by names to discover the role's nodes by.
    absent = [
        option
        for option in options.values()
        if option.required and not values[option.key] and not values.get(f"{option.key}_dns")
    ]
    if absent:
        needed = ", ".join(_required(option, options) for option in absent)
        raise MissingSettings(f"the following settings are required: {needed}")
    return values


def _required(option: Option, options: Mapping[str, Option]) -> str:
    alternative = options.get(f"{option.key}_dns")
    if alternative is None:
        return _spellings(option)
    return f"{_spellings(option)} or {_spellings(alternative)}"


def merge(options: Mapping[str, Option], *layers: Mapping[str, Any]) -> dict[str, Any]:
    """For each option the first layer that has it (highest precedence first), else its
    default."""
    values = {}
    for key, option in options.items():
        values[key] = next((layer[key] for layer in layers if key in layer), option.default)
    return values


def from_cli(given: Mapping[str, Any], options: Mapping[str, Option]) -> dict[str, Any]:
    """argparse already typed the flags; node URLs are parsed here, like the other sources'."""
    values = dict(given)
    for key in NODE_KEYS:
        if key in values and key in options:
            flag = options[key].flag
            values[key] = [_node_string(spec, flag) for spec in values[key]]
    for key in DNS_KEYS:
        role = options[key].dns if key in options else None
        if key in values and role is not None:
            values[key] = [_dns_string(spec, role, options[key].flag) for spec in values[key]]
    return values


def from_env(environ: Mapping[str, str], options: Mapping[str, Option]) -> dict[str, Any]:
    """``PD_ROUTER_*`` variables; an empty one counts as unset.

    Node lists are separated by whitespace: a comma already separates a node's own options
    (``http://d0:8200,slots=8``).
    """
    by_name = {option.env: option for option in options.values()}
    values: dict[str, Any] = {}
    for name, text in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or _service_link(name, text):
            continue
        option = by_name.get(name)
        if option is None:
            raise ConfigError(f"unknown environment variable {name}{suggest(name, by_name)}")
        text = text.strip()
        if not text:
            continue
        role = option.dns
        if option.nodes:
            values[option.key] = [_env_node(item, name) for item in text.split()]
        elif role is not None:
            values[option.key] = [_dns_string(item, role, name) for item in text.split()]
        elif option.many:
            values[option.key] = [_convert(option, item, name) for item in text.split()]
        elif option.switch:
            values[option.key] = _switch(text, name)
        else:
            values[option.key] = _convert(option, text, name)
    return values


def _service_link(name: str, value: str) -> bool:
    """Kubernetes injects, into every pod of a namespace, ``<SERVICE>_SERVICE_HOST``,
    ``<SERVICE>_PORT=tcp://...`` and the like for each Service: those of a Service named
    ``pd-router`` or ``pd-router-<anything>`` (the examples' ``pd-router-state``) start
    with ``PD_ROUTER_`` and are not settings. ``PD_ROUTER_PORT`` is one only as a URL."""
    rest = name[len(ENV_PREFIX) :]
    return bool(_SERVICE_LINK.fullmatch(rest)) or (
        "://" in value and (rest == "PORT" or rest.endswith("_PORT"))
    )


# What follows PD_ROUTER_ in a service link: [NAME_]SERVICE_HOST, [NAME_]SERVICE_PORT[_PORTNAME],
# [NAME_]PORT_<number>_<protocol>[_PROTO|_PORT|_ADDR].
_SERVICE_LINK = re.compile(
    r"([A-Z0-9_]+_)?"
    r"(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)"
)


def read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 (byte {exc.start})") from None


def from_file(
    document: Mapping[str, Any], options: Mapping[str, Option], source: str = "config file"
) -> dict[str, Any]:
    """A parsed TOML document: top-level keys are the flags' dests (``queue_timeout``)."""
    keys = {key: option for key, option in options.items() if key != CONFIG_KEY}
    values: dict[str, Any] = {}
    for key, value in document.items():
        option = keys.get(key)
        if option is None:
            raise ConfigError(
                f"{source}: unknown key {key!r}{suggest(key.replace('-', '_'), keys)}"
            )
        where = f"{source}: {key}"
        role = option.dns
        if option.nodes:
            values[key] = _file_nodes(value, where)
        elif role is not None:
            values[key] = _file_names(value, role, where)
        elif option.many:
            kind = "a number" if option.number else "a string"
            items = _one_or_array(value, where, kind, (int, float) if option.number else (str,))
            values[key] = [
                _convert(option, _scalar(option, item, f"{where}[{index}]"), f"{where}[{index}]")
                for index, item in enumerate(items)
            ]
        elif option.switch:
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {_spelled(value)}")
            values[key] = value
        else:
            values[key] = _convert(option, _scalar(option, value, where), where)
    return values


# Values


def _convert(option: Option, text: str, where: str) -> Any:
    """``text`` through the flag's own type function (and choices), as argparse would."""
    try:
        value = option.convert(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (TypeError, ValueError):
        name = _TYPE_WORDS.get(option.convert)
        if name is None:
            name = f"a valid {getattr(option.convert, '__name__', 'value')}"
        raise ConfigError(f"{where}: expected {name}, got {text!r}") from None
    if option.choices is not None and value not in option.choices:
        raise ConfigError(f"{where}: expected one of {', '.join(option.choices)}, got {text!r}")
    return value


def _scalar(option: Option, value: object, where: str) -> str:
    """A TOML value of the option's type, as the text a flag would have had."""
    if option.number:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {_spelled(value)}")
        return str(value)  # the type function checks its range (and that it is whole)
    if not isinstance(value, str):
        # A token written as a number is a token still: its kind is said, never it.
        shown = _kind(value) if option.key in SECRETS else _spelled(value)
        raise ConfigError(f"{where}: expected a string, got {shown}")
    return value


def _one_or_array(value: object, where: str, what: str, single: tuple[type, ...]) -> list[Any]:
    """A list setting's items: an array of them, or one alone."""
    if isinstance(value, single):
        return [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"{where}: expected {what}, or a non-empty array of them, got {_spelled(value)}"
        )
    return value


def _kind(value: object) -> str:
    """A TOML value's kind, for a setting whose value is never shown."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    return _spelled(value) if isinstance(value, list | dict) else "a value"


def _spelled(value: object) -> str:
    """A TOML value as the file spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "an empty array" if not value else "an array"
    if isinstance(value, dict):
        return "a table"
    return str(value)


def _switch(text: str, where: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ConfigError(f"{where}: expected one of {', '.join(_TRUE + _FALSE)}, got {text!r}")


# Nodes


def _node_string(spec: str, where: str) -> NodeSpec:
    try:
        return parse_spec(spec)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _env_node(item: str, where: str) -> NodeSpec:
    _url, _, options = item.partition(",")
    if "://" in options:
        raise ConfigError(
            f"{where}: {item!r}: separate nodes with spaces; a comma starts a node option "
            "(URL,slots=N)"
        )
    return _node_string(item, where)


def _file_nodes(value: object, where: str) -> list[NodeSpec]:
    what = "a URL or a table ({ url = ..., slots = N, labels = { ... } })"
    items = _one_or_array(value, where, what, (str, dict))
    return [_file_node(item, f"{where}[{index}]") for index, item in enumerate(items)]


def _file_node(item: object, where: str) -> NodeSpec:
    if isinstance(item, str):
        return _node_string(item, where)
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a URL or a table, got {item!r}")
    for key in item:
        if key not in NODE_TABLE_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(NODE_TABLE_KEYS)})")
    url = item.get("url")
    if not isinstance(url, str):
        raise ConfigError(f"{where}.url: expected a URL string, got {url!r}")
    if "," in url:
        # The table has its own keys for options: a comma option here would be ambiguous.
        raise ConfigError(f"{where}.url: {url!r}: give options as keys (slots = N)")
    slots = item.get("slots")
    if slots is not None and (
        not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= MAX_SLOTS
    ):
        raise ConfigError(
            f"{where}.slots: expected a whole number from 1 to {MAX_SLOTS}, got {slots!r}"
        )
    try:
        url = normalise_url(url)
    except ValueError as exc:
        raise ConfigError(f"{where}.url: {exc}") from None
    try:
        labels = check_labels(item.get("labels", {}))
    except ValueError as exc:
        raise ConfigError(f"{where}.labels: {exc}") from None
    return NodeSpec(url, slots, labels)


# Names to discover nodes by


def _dns_string(spec: str, role: Role, where: str) -> DnsSpec:
    try:
        return parse_dns_spec(spec, role)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _file_names(value: object, role: Role, where: str) -> list[DnsSpec]:
    what = "NAME:PORT or a table ({ name = ..., port = N, slots = N, labels = { ... } })"
    items = _one_or_array(value, where, what, (str, dict))
    return [_file_name(item, role, f"{where}[{index}]") for index, item in enumerate(items)]


def _file_name(item: object, role: Role, where: str) -> DnsSpec:
    if isinstance(item, str):
        return _dns_string(item, role, where)
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected NAME:PORT or a table, got {item!r}")
    for key in item:
        if key not in DNS_TABLE_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(DNS_TABLE_KEYS)})")
    name, port, slots = item.get("name"), item.get("port"), item.get("slots")
    if not isinstance(name, str):
        raise ConfigError(f"{where}.name: expected a DNS name, got {name!r}")
    for key, number in (("port", port), ("slots", slots)):
        if number is not None and (not isinstance(number, int) or isinstance(number, bool)):
            raise ConfigError(f"{where}.{key}: expected a whole number, got {number!r}")
    try:
        labels = check_labels(item.get("labels", {}))
        return dns_spec(role, name, port, slots, labels)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# Messages


def _spellings(option: Option) -> str:
    return f"{option.flag} (or {option.env}, or {option.key} in the config file)"
