"""Node features: Slurm's `--constraint` expressions, and which nodes satisfy them.

The rule: a node has feature F when it carries a label named F, whatever its value (so
`trainyard node add --label a100` and `--label a100=` both give the feature `a100`). A term
written `KEY=VALUE` matches a label with that value, which keeps trainyard's own LABEL=VALUE
constraints in the same syntax. Stdlib only.

Grammar (Slurm's): terms joined by `&` (or `,`, both AND) and `|` (OR, binding looser than
AND), parentheses for grouping, `[a|b]` for "all nodes with the same one of a or b", and a
node count `a100*2` (read, not enforced: the count is dropped with a note).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_TOKEN = re.compile(r"\s*(?:(?P<op>[&|,()\[\]])|(?P<term>[A-Za-z0-9_.:/+=-]+(?:\*\d+)?))")


class ConstraintError(ValueError):
    """A constraint expression that cannot be read."""


@dataclass(frozen=True)
class Term:
    name: str
    value: str | None = None  # KEY=VALUE terms

    def __str__(self) -> str:
        return self.name if self.value is None else f"{self.name}={self.value}"


@dataclass(frozen=True)
class All:
    parts: tuple[Expr, ...]

    def __str__(self) -> str:
        return "&".join(f"({p})" if isinstance(p, Any_) and not p.matching else str(p)
                        for p in self.parts)


@dataclass(frozen=True)
class Any_:
    parts: tuple[Expr, ...]
    matching: bool = False  # [a|b]: every node of the job takes the same choice

    def __str__(self) -> str:
        inner = "|".join(str(p) for p in self.parts)
        return f"[{inner}]" if self.matching else inner


Expr = Term | All | Any_


@dataclass(frozen=True)
class Constraint:
    expr: Expr
    counts_dropped: tuple[str, ...] = ()  # `a100*2` node counts that were read but not enforced

    def __str__(self) -> str:
        return str(self.expr)

    def features(self) -> set[str]:
        out: set[str] = set()

        def walk(e: Expr) -> None:
            if isinstance(e, Term):
                out.add(str(e))
            else:
                for p in e.parts:
                    walk(p)

        walk(self.expr)
        return out


def parse_constraint(text: str) -> Constraint:
    """'gpu&(a100|h100)' -> Constraint; raises ConstraintError naming the place it stopped."""
    tokens: list[tuple[str, str]] = []
    pos, text = 0, text.strip()
    if not text:
        raise ConstraintError("empty constraint; name node features, e.g. a100 or gpu&ib")
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ConstraintError(f"constraint {text!r}: cannot read {text[pos:]!r}; "
                                  "use feature names joined by & and |, e.g. gpu&(a100|h100)")
        pos = m.end()
        tokens.append(("op", m.group("op")) if m.group("op") else ("term", m.group("term")))
        if text[pos:].strip() == "":
            break
    dropped: list[str] = []
    at = 0

    def peek() -> tuple[str, str] | None:
        return tokens[at] if at < len(tokens) else None

    def take() -> tuple[str, str]:
        nonlocal at
        if at >= len(tokens):
            raise ConstraintError(f"constraint {text!r} ends too early")
        at += 1
        return tokens[at - 1]

    def disjunction(close: str | None) -> Expr:
        parts = [conjunction(close)]
        while peek() == ("op", "|"):
            take()
            parts.append(conjunction(close))
        return parts[0] if len(parts) == 1 else Any_(tuple(parts))

    def conjunction(close: str | None) -> Expr:
        parts = [atom(close)]
        while peek() in (("op", "&"), ("op", ",")):
            take()
            parts.append(atom(close))
        return parts[0] if len(parts) == 1 else All(tuple(parts))

    def atom(close: str | None) -> Expr:
        kind, value = take()
        if kind == "term":
            name, star, count = value.partition("*")
            if star:
                dropped.append(value)
            key, eq, val = name.partition("=")
            if eq and not key:
                raise ConstraintError(f"constraint {text!r}: {value!r} has no label name before '='")
            return Term(key, val) if eq else Term(name)
        if value in "([":
            end = ")" if value == "(" else "]"
            inner = disjunction(end)
            if take() != ("op", end):
                raise ConstraintError(f"constraint {text!r}: {value!r} is not closed with {end!r}")
            if value == "[":
                return Any_(inner.parts, matching=True) if isinstance(inner, Any_) else inner
            return inner
        raise ConstraintError(f"constraint {text!r}: unexpected {value!r}")

    expr = disjunction(None)
    if at != len(tokens):
        raise ConstraintError(f"constraint {text!r}: unexpected {tokens[at][1]!r}")
    return Constraint(expr, tuple(dropped))


def satisfies(constraint: Constraint | str, labels: Mapping[str, str]) -> bool:
    """Whether one node with these labels satisfies the expression (per-node view of `[a|b]`)."""
    c = parse_constraint(constraint) if isinstance(constraint, str) else constraint

    def ok(e: Expr) -> bool:
        if isinstance(e, Term):
            if e.value is None:
                return e.name in labels
            return labels.get(e.name) == e.value
        if isinstance(e, All):
            return all(ok(p) for p in e.parts)
        return any(ok(p) for p in e.parts)

    return ok(c.expr)
