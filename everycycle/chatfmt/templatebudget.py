"""The render budget of a chat template: a GGUF's template is a stranger's code.

Jinja's sandbox stops attribute escapes, not work: ``range`` is capped at 100,000 items,
but two nested loops run 10^10 steps, and ``('x' * 100000) * 5000`` is a 500 MB string.
A render here is bounded three ways:

- **bytes**: every string or list a template builds (``*``, ``+``, ``~``, ``%``, the
  ``join``/``replace``/``center``/``indent``/``format`` filters and string methods) is
  checked *before* it is built where its size can be known, and after every call
  otherwise; the output is summed as it is produced. The cap is relative to the model's
  context (``output_cap``).
- **operations**: each intercepted operation counts; ``MAX_OPERATIONS`` ends it.
- **time**: a watchdog thread raises ``RenderTimeout`` in the rendering thread once its
  deadline passes (``PyThreadState_SetAsyncExc``: it interrupts pure-Python loops at the
  next bytecode, costing nothing while a render stays within its time).

Any of these raises ``RenderBudgetError`` from the render; the caller turns it into the
request's error. Nothing here knows llama.cpp.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import itertools
import re
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_SECONDS = 3.0
"""How long one render may run."""
MAX_OPERATIONS = 2_000_000
"""Intercepted operations (arithmetic, calls, filters, joins) in one render."""
MIN_OUTPUT_BYTES = 1 << 20
BYTES_PER_TOKEN = 32


def output_cap(n_ctx: int) -> int:
    """The largest prompt (and intermediate value) a render may build for a context of
    ``n_ctx`` tokens: 32 bytes a token, at least 1 MiB."""
    return max(MIN_OUTPUT_BYTES, BYTES_PER_TOKEN * n_ctx)


class RenderBudgetError(Exception):
    """A render went over its budget; the message says which part."""


class RenderTimeout(BaseException):
    """Raised asynchronously in a render that ran past its deadline (a BaseException, so
    that no ``except Exception`` inside a template's helpers swallows it)."""


@dataclass
class Budget:
    """One render's allowance, counted down as it runs (one thread)."""

    max_bytes: int
    seconds: float = MAX_SECONDS
    operations: int = MAX_OPERATIONS
    produced: int = 0

    def step(self) -> None:
        self.operations -= 1
        if self.operations < 0:
            raise RenderBudgetError(f"over {MAX_OPERATIONS:,} operations")

    def size(self, n: int, what: str) -> None:
        """Refuse a value of ``n`` characters (or items) before it is built."""
        if n > self.max_bytes:
            raise RenderBudgetError(f"{what} of {n:,} characters (at most "
                                    f"{self.max_bytes:,})")

    def check(self, value: object, what: str) -> object:
        if isinstance(value, str | list | tuple | dict | bytes):
            self.size(weight(value, self.max_bytes), what)
        return value

    def output(self, pieces: Iterable[str]) -> Iterator[str]:
        for piece in pieces:
            self.produced += len(piece)
            if self.produced > self.max_bytes:
                raise RenderBudgetError(f"a prompt over {self.max_bytes:,} characters")
            yield piece


_local = threading.local()


def current() -> Budget | None:
    budget: Budget | None = getattr(_local, "budget", None)
    return budget


# ---------------------------------------------------------------------- size estimates


def _length(value: object) -> int:
    return weight(value) if isinstance(value, str | list | tuple | dict | bytes) else len(
        str(value))


def weight(value: object, cap: int = 1 << 62) -> int:
    """About how many characters ``value`` renders to: a string its length, a list or
    dict the sum of its items' (counting stops past ``cap``), anything else 1."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list | tuple):
        total = len(value)
        for item in value:
            total += weight(item, cap - total)
            if total > cap:
                break
        return total
    return 1


def _repeat(left: object, right: object, cap: int) -> int | None:
    """The weight of ``left * right`` for a sequence and an int, else None."""
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, str | list | tuple) and isinstance(n, int) and not isinstance(
                n, bool):
            return weight(seq, cap) * max(n, 0)
    return None


_PRINTF_WIDTH = re.compile(r"%[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")


def _printf_width(fmt: str) -> int:
    """The widths and precisions a %-format asks for, summed."""
    total = 0
    for m in _PRINTF_WIDTH.finditer(fmt):
        for g in m.groups():
            if g is not None and g != "*":
                total += int(g)
    return total


def _format_width(fmt: str) -> int:
    total = 0
    with contextlib.suppress(ValueError):
        for _, _, spec, _ in string.Formatter().parse(fmt):
            for number in re.findall(r"\d+", spec or ""):
                total += int(number)
    return total


def _join_size(sep: object, items: list[Any]) -> int:
    return sum(_length(i) for i in items) + _length(sep) * max(len(items) - 1, 0)


def _replace_size(s: str, old: object, new: object, count: object = -1) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _method_size(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The size a str method's result would have, where it can be large, else None."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return None
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        return max(args[0], len(owner))
    if name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        return len(owner) + owner.count("\t") * max(int(tab), 0)
    if name == "replace" and len(args) >= 2:
        return _replace_size(owner, *args[:3])
    if name in ("format", "format_map"):
        values = [*args, *kwargs.values()]
        if name == "format_map" and args and isinstance(args[0], dict):
            values = list(args[0].values())
        widest = max((weight(v) for v in values), default=0)
        return len(owner) + _format_width(owner) + owner.count("{") * widest
    return None


# ---------------------------------------------------------------------- the environment


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' immutable sandbox, with every size-changing operation counted and
    checked against the render's ``Budget`` (none outside a budgeted render)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    concat = staticmethod(lambda parts: budgeted_concat(parts))
    """Block bodies (``{% set %}…{% endset %}``, filter blocks, macros) join through it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.globals.pop("lipsum", None)  # (a Python loop of any length; no template uses it)
        for name in ("join", "replace", "center", "indent", "format", "wordwrap",
                     "truncate", "tojson", "string", "list", "pprint"):
            if name in self.filters:
                self.filters[name] = _checked_filter(name, self.filters[name])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        if budget is not None:
            budget.step()
            if operator == "*":
                n = _repeat(left, right, budget.max_bytes)
                if n is not None:
                    budget.size(n, "a repetition")
            elif operator == "+" and isinstance(left, str | list | tuple) and isinstance(
                    right, type(left)):
                budget.size(weight(left, budget.max_bytes) + weight(right, budget.max_bytes),
                            "a concatenation")
            elif operator == "%" and isinstance(left, str):
                budget.size(len(left) + _printf_width(left) + left.count("%")
                            * weight(right, budget.max_bytes), "a %-format")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and (
                    right > 4096 or left.bit_length() * max(right, 0) > 1 << 16):
                raise RenderBudgetError(f"a power {left}**{right}")
        result = self.binop_table[operator](left, right)
        if budget is not None:
            budget.check(result, "a value")
        return result

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = current()
        if budget is not None:
            budget.step()
            size = _method_size(obj, args, kwargs)
            if size is not None:
                budget.size(size, f"a .{getattr(obj, '__name__', 'call')}() result")
            elif getattr(obj, "__name__", "") == "join" and isinstance(
                    getattr(obj, "__self__", None), str) and args:
                items = list(itertools.islice(args[0], budget.max_bytes + 1))
                budget.size(len(items), "a list")
                budget.size(_join_size(obj.__self__, items), "a join")
                args = (items, *args[1:])
        result = super().call(context, obj, *args, **kwargs)
        if budget is not None:
            budget.check(result, "a value")
        return result


def _checked_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its result's size checked (and, for the filters whose result can be
    far larger than their input, its size estimated first)."""
    passes = getattr(fn, "jinja_pass_arg", None)

    def checked(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        if budget is None:
            return fn(*args, **kwargs)
        budget.step()
        args = _precheck(name, budget, args[1:] if passes else args, kwargs, args[:1]
                         if passes else ())
        result = fn(*args, **kwargs)
        return budget.check(result, f"a |{name} result")

    checked.__name__ = getattr(fn, "__name__", name)
    checked.__doc__ = fn.__doc__
    if passes is not None:
        checked.jinja_pass_arg = passes  # type: ignore[attr-defined]
    return checked


def _precheck(name: str, budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any],
              passed: tuple[Any, ...]) -> tuple[Any, ...]:
    """Refuse a filter call whose result would be over the cap; returns the arguments
    (an iterable to join materialized, at most the cap's length)."""
    if not args:
        return (*passed, *args)
    value, rest = args[0], args[1:]
    if name == "join":
        items = list(itertools.islice(value, budget.max_bytes + 1))
        budget.size(len(items), "a list")
        sep = rest[0] if rest else kwargs.get("d", "")
        budget.size(_join_size(sep, items), "a |join result")
        value = items
    elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
        budget.size(_replace_size(value, *rest[:3]), "a |replace result")
    elif name == "center":
        width = rest[0] if rest else kwargs.get("width", 80)
        budget.size(max(int(width), _length(value)), "a |center result")
    elif name == "indent":
        width = rest[0] if rest else kwargs.get("width", 4)
        lines = str(value).count("\n") + 1
        budget.size(len(str(value)) + lines * (width if isinstance(width, int)
                                                 else len(str(width))), "an |indent result")
    elif name == "format" and isinstance(value, str):
        widest = max((weight(v) for v in (*rest, *kwargs.values())), default=0)
        budget.size(len(value) + _printf_width(value) + value.count("%") * widest,
                    "a |format result")
    elif name in ("string", "tojson", "pprint"):
        budget.size(weight(value, budget.max_bytes) * 2, f"a |{name} result")
    elif name == "tojson":
        indent = rest[2] if len(rest) > 2 else kwargs.get("indent")
        if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(
                indent) > 64:
            raise RenderBudgetError(f"a |tojson indent of {indent!r}")
    return (*passed, value, *rest)


def budgeted_concat(parts: Iterable[str]) -> str:
    """Jinja's ``concat`` of a block's output, with its size checked first."""
    pieces = list(parts)
    budget = current()
    if budget is not None:
        budget.step()
        budget.size(sum(len(p) for p in pieces), "a block's output")
    return "".join(pieces)


def str_join(seq: Iterable[Any]) -> str:
    """Jinja's ``~`` (runtime.str_join), with its result's size checked first."""
    parts = [str(x) for x in seq]
    budget = current()
    if budget is not None:
        budget.step()
        budget.size(sum(len(p) for p in parts), "a ~ concatenation")
    return "".join(parts)


# ---------------------------------------------------------------------- time


@dataclass(order=True)
class _Deadline:
    at: float
    seq: int
    thread: int = field(compare=False)
    live: bool = field(default=True, compare=False)
    fired: bool = field(default=False, compare=False)


class _Watchdog:
    """One thread for every render's deadline: at its time, a render still running has
    RenderTimeout raised in its thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[_Deadline] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> _Deadline:
        entry = _Deadline(time.monotonic() + seconds, next(self._seq), threading.get_ident())
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="render watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return entry

    def disarm(self, entry: _Deadline) -> bool:
        """Stop watching ``entry``; True when it had fired (any exception it raised that
        is still pending is taken back)."""
        with self._cond:
            entry.live = False
            fired = entry.fired
        if fired:
            _async_raise(entry.thread, None)
        return fired

    def release_if_held(self) -> None:
        """Release the lock if this thread holds it: a RenderTimeout raised while
        ``disarm`` entered it (after acquiring, before its block) left it held."""
        while self._cond._is_owned():  # type: ignore[attr-defined]
            self._cond.release()

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and not self._heap[0].live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0].at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                entry = heapq.heappop(self._heap)
                entry.fired = True
                _async_raise(entry.thread, RenderTimeout)


def _async_raise(thread: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                               ctypes.py_object(exc) if exc else None)


_watchdog = _Watchdog()


def bounded(render: Callable[[], Iterable[str]], max_bytes: int,
            seconds: float = MAX_SECONDS) -> str:
    """Run ``render`` (a template's ``generate``) under a budget of ``max_bytes``,
    ``MAX_OPERATIONS`` and ``seconds``. Raises RenderBudgetError naming what ran out."""
    budget = Budget(max_bytes, seconds)
    outer = current()
    _local.budget = budget
    deadline = _watchdog.arm(seconds)
    try:
        try:
            out = "".join(budget.output(render()))
        finally:
            fired = _watchdog.disarm(deadline)
    except RenderTimeout:  # (raised at most once a deadline, perhaps during disarm)
        fired = True
        _watchdog.release_if_held()
        _watchdog.disarm(deadline)
    except MemoryError:
        raise RenderBudgetError("out of memory") from None
    finally:
        _local.budget = outer
    if fired:
        raise RenderBudgetError(f"over {seconds:g} s")
    return out
