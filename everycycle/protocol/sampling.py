"""The sampling parameters: one table, from which everything else is derived.

Each :class:`Param` says its name, type, range, default, help text, which HTTP
dialects take it (under its own name, as llama-server and Ollama do), and which of
llama.cpp's samplers applies it. From ``PARAMS`` come the protocol's Generate fields
and their checks (the seed's six keep their wire places; the others are extensions),
the models.toml keys, the CLI's ``--temperature``/``--top-p``/``--top-k``/``--seed``
and ``-o NAME=VALUE``, every dialect's mapping, the engine's defaults and its greedy
rule, and docs/models.md's table (checked by a test). The engine's sampler chain
(``engine/sampling.py``) reads the values by these constants.

Adding a parameter: a ``Param`` here, in ``PARAMS``, and the line of the engine's
chain that applies it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from ..errors import ProtocolError
from .validation import TOKEN_ID_MAX, U32_MAX, check_range, message

V = TypeVar("V")

OPENAI = "openai"
"""OpenAI's chat and text completions, with llama-server's extensions to them."""
OLLAMA = "ollama"
"""Ollama's ``options``."""
ANTHROPIC = "anthropic"
RESPONSES = "responses"
DIALECTS = (OPENAI, OLLAMA, ANTHROPIC, RESPONSES)

MAX_BIASES = 1024
MAX_BREAKERS = 16
MAX_BREAKER_CHARS = 40


@message(ranges={"token": (0, TOKEN_ID_MAX), "bias": (-100.0, 100.0)})
class Bias:
    """A logit bias: ``bias`` added to token ``token``'s logit (-100 all but bans it)."""

    token: int
    bias: float


@dataclass(frozen=True, slots=True)
class Param(Generic[V]):
    """One sampling parameter."""

    name: str
    kind: str
    """``int``, ``float``, ``strings`` (a list of strings) or ``biases`` (token → bias)."""
    default: V
    help: str
    sampler: str
    """The llama.cpp sampler that applies it (``llama_sampler_init_…``)."""
    low: float = -math.inf
    high: float = math.inf
    seed: bool = False
    """One of the Rust seed's Generate fields (their wire order is fixed there)."""
    dialects: frozenset[str] = frozenset({OPENAI, OLLAMA})
    flag: bool = False
    """Offered as its own CLI option (``--top-p``), besides ``-o NAME=VALUE``."""
    neutral: object = None
    """For a parameter that can change greedy decoding's choice: the value at which
    it does nothing (greedy decoding is a plain argmax only when all are neutral)."""
    negative_unset: bool = False
    """A negative value from a dialect means "unset" (Ollama's and llama-server's seed
    -1: random)."""
    choices: frozenset[str] | None = None
    """For ``strings``: the only strings it takes (none: any)."""

    @property
    def annotation(self) -> str:
        """Its type as Generate declares it."""
        return {"int": "int | None", "float": "float | None",
                "strings": "tuple[str, ...] | None",
                "biases": "tuple[Bias, ...] | None"}[self.kind]

    @property
    def bounded(self) -> bool:
        return self.kind in ("int", "float")

    def check(self, value: object) -> None:
        """Raises ProtocolError unless ``value`` (not None) is valid for this parameter."""
        if self.bounded:
            check_range(self.name, cast(float, value), self.low, self.high)
        elif self.kind == "strings":
            items = cast(tuple[str, ...], value)
            if len(items) > MAX_BREAKERS:
                raise ProtocolError(f"{self.name}: at most {MAX_BREAKERS} strings")
            if any(not 1 <= len(s) <= MAX_BREAKER_CHARS for s in items):
                raise ProtocolError(f"{self.name}: each string must be 1-{MAX_BREAKER_CHARS} "
                                    "characters")
            if self.choices is not None and (odd := [s for s in items
                                                     if s not in self.choices]):
                raise ProtocolError(f"{self.name}: {odd[0]!r} is not one (one of "
                                    f"{', '.join(sorted(self.choices))})")
        elif len(cast(tuple[Bias, ...], value)) > MAX_BIASES:
            raise ProtocolError(f"{self.name}: at most {MAX_BIASES} tokens")

    def __repr__(self) -> str:
        return f"Param({self.name})"


def _p(name: str, kind: str, default: Any, help: str, sampler: str, **kw: Any) -> Param[Any]:
    return Param(name, kind, default, help, sampler, **kw)


EVERY = frozenset(DIALECTS)

# The seed's six, in their wire order.
TEMPERATURE: Param[float] = _p(
    "temperature", "float", 0.8, "Sampling temperature; 0 is greedy.", "temp",
    low=0.0, high=100.0, seed=True, dialects=EVERY, flag=True)
TOP_P: Param[float] = _p(
    "top_p", "float", 0.95, "Nucleus sampling: the smallest set of tokens whose "
    "probabilities add up to P.", "top_p", low=0.0, high=1.0, seed=True, dialects=EVERY,
    flag=True)
TOP_K: Param[int] = _p(
    "top_k", "int", 40, "Sample among the K likeliest tokens; 0 for all.", "top_k",
    low=0, high=1_000_000, seed=True,
    dialects=frozenset({OPENAI, OLLAMA, ANTHROPIC}), flag=True)
MIN_P: Param[float] = _p(
    "min_p", "float", 0.05, "Drop tokens less likely than P times the likeliest.",
    "min_p", low=0.0, high=1.0, seed=True)
REPEAT_PENALTY: Param[float] = _p(
    "repeat_penalty", "float", 1.0, "Divide the logits of recent tokens by this (1: off).",
    "penalties", low=0.01, high=10.0, seed=True, neutral=1.0)
SEED: Param[int | None] = _p(
    "seed", "int", None, "Sampling seed, for repeatable output; random when unset.", "dist",
    low=0, high=U32_MAX - 1, seed=True, flag=True, negative_unset=True)

# Extensions: llama-server's and Ollama's names.
REPEAT_LAST_N: Param[int] = _p(
    "repeat_last_n", "int", 64, "How many recent tokens the penalties look at "
    "(-1: the whole context, 0: none).", "penalties", low=-1, high=1 << 20)
PRESENCE_PENALTY: Param[float] = _p(
    "presence_penalty", "float", 0.0, "Subtract this from the logit of every token "
    "already in the recent output.", "penalties", low=-2.0, high=2.0, neutral=0.0)
FREQUENCY_PENALTY: Param[float] = _p(
    "frequency_penalty", "float", 0.0, "Subtract this times its count from the logit of "
    "each token in the recent output.", "penalties", low=-2.0, high=2.0, neutral=0.0)
LOGIT_BIAS: Param[tuple[Bias, ...]] = _p(
    "logit_bias", "biases", (), "Add a bias (-100 to 100) to chosen tokens' logits; "
    "-100 all but bans one.", "logit_bias", dialects=frozenset({OPENAI}), neutral=())
TYPICAL_P: Param[float] = _p(
    "typical_p", "float", 1.0, "Locally typical sampling (1: off).", "typical",
    low=0.0, high=1.0)
MIROSTAT: Param[int] = _p(
    "mirostat", "int", 0, "Mirostat sampling, version 1 or 2 (0: off); replaces the "
    "filters by a target surprise.", "mirostat", low=0, high=2)
MIROSTAT_TAU: Param[float] = _p(
    "mirostat_tau", "float", 5.0, "Mirostat's target surprise (entropy).", "mirostat",
    low=0.0, high=100.0)
MIROSTAT_ETA: Param[float] = _p(
    "mirostat_eta", "float", 0.1, "Mirostat's learning rate.", "mirostat",
    low=0.0, high=1.0)
DRY_MULTIPLIER: Param[float] = _p(
    "dry_multiplier", "float", 0.0, "DRY: penalize extending a repeated sequence "
    "(0: off).", "dry", low=0.0, high=100.0, dialects=frozenset({OPENAI}), neutral=0.0)
DRY_BASE: Param[float] = _p(
    "dry_base", "float", 1.75, "DRY: the penalty grows as this to the power of the "
    "repetition's length.", "dry", low=0.0, high=100.0, dialects=frozenset({OPENAI}))
DRY_ALLOWED_LENGTH: Param[int] = _p(
    "dry_allowed_length", "int", 2, "DRY: repetitions up to this long go unpenalized.",
    "dry", low=0, high=10_000, dialects=frozenset({OPENAI}))
DRY_PENALTY_LAST_N: Param[int] = _p(
    "dry_penalty_last_n", "int", -1, "DRY: how many recent tokens it scans (-1: the whole "
    "context, 0: none).", "dry", low=-1, high=1 << 20, dialects=frozenset({OPENAI}))
DRY_SEQUENCE_BREAKERS: Param[tuple[str, ...]] = _p(
    "dry_sequence_breakers", "strings", ("\n", ":", "\"", "*"), "DRY: strings that end a "
    "repeated sequence.", "dry", dialects=frozenset({OPENAI}))
XTC_PROBABILITY: Param[float] = _p(
    "xtc_probability", "float", 0.0, "XTC: how often to exclude the top choices "
    "(0: never).", "xtc", low=0.0, high=1.0, dialects=frozenset({OPENAI}), neutral=0.0)
XTC_THRESHOLD: Param[float] = _p(
    "xtc_threshold", "float", 0.1, "XTC: the probability above which a choice counts as "
    "top (over 0.5: off).", "xtc", low=0.0, high=1.0, dialects=frozenset({OPENAI}))
TOP_N_SIGMA: Param[float] = _p(
    "top_n_sigma", "float", -1.0, "Keep tokens within N standard deviations of the top "
    "logit (-1: off).", "top_n_sigma", low=-1.0, high=100.0, dialects=frozenset({OPENAI}))

ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
         "temperature")
"""llama-server's default order of its samplers (after the logit biases, before the
draw)."""
_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
          "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}
"""llama-server's one-letter names (``"samplers": "kpit"``)."""
_ALIASES = {**{alt: n for n in _CHARS.values() if "_" in n
               for alt in (n.replace("_", "-"), n.replace("_", ""))},
            "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
"""Other names llama-server takes for them (``top-k``, ``topk``, ``temp``, …)."""
_NAMES = frozenset(_CHARS.values())
SAMPLERS: Param[tuple[str, ...]] = _p(
    "samplers", "strings", ORDER, "The samplers in the order they run (llama-server's "
    "names; `infill` favours ending a fill-in-the-middle where it fits).", "chain",
    dialects=frozenset({OPENAI}), neutral=ORDER, choices=_NAMES)

PARAMS: tuple[Param[Any], ...] = (
    TEMPERATURE, TOP_P, TOP_K, MIN_P, REPEAT_PENALTY, SEED, REPEAT_LAST_N,
    PRESENCE_PENALTY, FREQUENCY_PENALTY, LOGIT_BIAS, TYPICAL_P, MIROSTAT, MIROSTAT_TAU,
    MIROSTAT_ETA, DRY_MULTIPLIER, DRY_BASE, DRY_ALLOWED_LENGTH, DRY_PENALTY_LAST_N,
    DRY_SEQUENCE_BREAKERS, XTC_PROBABILITY, XTC_THRESHOLD, TOP_N_SIGMA, SAMPLERS)
BY_NAME: Mapping[str, Param[Any]] = {p.name: p for p in PARAMS}
SEED_PARAMS = tuple(p for p in PARAMS if p.seed)
EXTENSION_PARAMS = tuple(p for p in PARAMS if not p.seed)
RANGES = {p.name: (p.low, p.high) for p in PARAMS if p.bounded}


def with_extensions(cls: type[V]) -> type[V]:
    """Declare the extension parameters on ``cls`` (Generate, before it becomes a
    message): each an optional field, absent from the wire when unset."""
    from dataclasses import field

    for p in EXTENSION_PARAMS:
        cls.__annotations__[p.name] = p.annotation
        setattr(cls, p.name, field(default=None, metadata={"skip_none": True}))
    return cls


def check(message: object) -> None:
    """Raises ProtocolError unless the parameters set on ``message`` are valid (the
    ranges are the message's to check)."""
    for p in PARAMS:
        if not p.bounded and (value := getattr(message, p.name)) is not None:
            p.check(value)


def to_json(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (by name) as JSON values: a logit bias as an object of token → bias."""
    return {name: {str(b.token): b.bias for b in value} if BY_NAME[name].kind == "biases"
            else list(value) if isinstance(value, tuple) else value
            for name, value in values.items()}


def values_of(message: object) -> dict[str, Any]:
    """The sampling parameters set on ``message`` (a Generate), by name."""
    return {p.name: v for p in PARAMS if (v := getattr(message, p.name)) is not None}


def biases_from_json(where: str, raw: object) -> tuple[Bias, ...]:
    """OpenAI's ``logit_bias`` (an object of token id → bias) or llama-server's list of
    ``[token id, bias]`` pairs. Raises ProtocolError naming ``where``."""
    pairs: list[tuple[object, object]]
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        pairs = [(p[0], p[1]) for p in raw]
    else:
        raise ProtocolError(f"{where} must be an object of token id → bias")
    out = []
    for key, bias in pairs:
        token = key if isinstance(key, int) else (int(key) if isinstance(key, str)
                                                  and key.isdigit() else None)
        if token is None or isinstance(key, bool):
            raise ProtocolError(f"{where}: {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise ProtocolError(f"{where}[{key}] must be a number")
        try:
            out.append(Bias(token, float(bias)))
        except ProtocolError as exc:
            raise ProtocolError(f"{where}[{key}]: {exc.message}") from None
    return tuple(out)


def from_json(dialect: str | None, data: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """The sampling parameters ``dialect`` takes from ``data`` (a request body, Ollama's
    ``options``; None: every parameter, as models.toml), by name, with JSON's types
    checked (a bool is no number; ranges are Generate's to check: see ``checked``).
    Raises ProtocolError naming the field."""
    out: dict[str, Any] = {}
    for p in PARAMS:
        value = data.get(p.name)
        if value is None or (dialect is not None and dialect not in p.dialects):
            continue
        name = f"{where}{p.name}"
        if p.kind == "biases":
            out[p.name] = biases_from_json(name, value)
            continue
        if p.kind == "strings":
            if isinstance(value, str) and value.startswith("["):  # (SillyTavern sends JSON)
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            if p is SAMPLERS and isinstance(value, str):  # (llama-server's letters)
                value = [_CHARS.get(c, c) for c in value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise ProtocolError(f"{name} must be a list of strings")
            if p is SAMPLERS:  # (names it does not know are left out, as llama-server
                # leaves them: SillyTavern sends "tfs_z" and "typical_p")
                value = [n for s in value if (n := _ALIASES.get(s.lower(), s.lower()))
                         in _NAMES]
            out[p.name] = tuple(value)
            continue
        wanted = int if p.kind == "int" else int | float
        if isinstance(value, bool) or not isinstance(value, wanted):
            kind = "an integer" if p.kind == "int" else "a number"
            raise ProtocolError(f"{name} must be {kind}")
        if p.negative_unset and value < 0:
            continue
        out[p.name] = value
    return out


def checked(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """``values`` (by name), if each is in its parameter's range. Raises ProtocolError."""
    for name, value in values.items():
        p = BY_NAME[name]
        if p.bounded:
            check_range(name, value, p.low, p.high)
        else:
            p.check(value)
    return values


def from_text(name: str, text: str) -> tuple[str, Any]:
    """A CLI ``-o NAME=VALUE``'s parameter name and value. Raises ProtocolError."""
    p = BY_NAME.get(name.replace("-", "_"))
    if p is None:
        raise ProtocolError(f"unknown sampling option '{name}' (one of "
                            f"{', '.join(q.name for q in PARAMS)})")
    try:
        if p.kind == "int":
            return p.name, int(text)
        if p.kind == "float":
            return p.name, float(text)
    except ValueError:
        raise ProtocolError(f"{p.name} must be {'an integer' if p.kind == 'int' else 'a number'}"
                            f", not {text!r}") from None
    if p.kind == "strings":
        items = [s for s in text.split(",") if s]
        if p is SAMPLERS:  # (an unknown name is refused by the check, naming them)
            items = [_ALIASES.get(s.lower(), s.lower()) for s in items]
        return p.name, tuple(items)
    try:
        raw = json.loads(text)
    except ValueError:
        raise ProtocolError(f"{p.name} must be a JSON object of token id → bias, "
                            f"like '{{\"1234\": -100}}'") from None
    return p.name, biases_from_json(p.name, raw)


def markdown() -> str:
    """docs/models.md's table of sampling parameters."""
    names = {OPENAI: "OpenAI", OLLAMA: "Ollama", ANTHROPIC: "Anthropic",
             RESPONSES: "Responses"}
    head = ("| parameter | type | range | default | HTTP dialects | llama.cpp sampler | "
            "what it does |")
    rows = [head, "|---|---|---|---|---|---|---|"]
    for p in PARAMS:
        span = f"{p.low:g} to {p.high:g}" if p.bounded else ""
        if p.kind == "biases":
            default, span = "none", "-100 to 100 a token"
        elif p.kind == "strings":
            default = " ".join(repr(s).replace("|", "\\|") for s in p.default)
        else:
            default = "random" if p.default is None else f"{p.default:g}"
        dialects = ", ".join(names[d] for d in DIALECTS if d in p.dialects)
        rows.append(f"| `{p.name}` | {p.kind} | {span} | {default} | {dialects} | "
                    f"`{p.sampler}` | {p.help} |")
    return "\n".join(rows) + "\n"
