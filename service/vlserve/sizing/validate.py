"""Facts checked against their schema before anything is planned, with the standard library only.

A captured facts file, a what-if copy or a hand edit may be truncated, miss a section, hold a
string where a number belongs or a negative count. The planner would then plan nonsense or raise
deep inside; instead `check_facts` answers one line naming the field and what is wrong with it.
It reads the published schema (facts_schema.py) and knows the JSON Schema keywords that schema
uses: type, const, enum, required, properties, additionalProperties, items, minItems, minimum,
oneOf and $ref to $defs.
"""

from __future__ import annotations

from typing import Any

from .facts_schema import SCHEMA


class FactsError(ValueError):
    """The facts do not follow their schema; the message names the field."""


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "null": lambda v: v is None,
}


def check_facts(facts: Any) -> None:
    """Raise FactsError with one line naming the first field that does not follow the schema."""
    if not isinstance(facts, dict):
        raise FactsError("facts must be a JSON object, not %s" % type(facts).__name__)
    if facts.get("schema") != SCHEMA["properties"]["schema"]["const"]:
        raise FactsError(
            "facts schema %r is not %r (a newer or older vlserve wrote them)"
            % (facts.get("schema"), SCHEMA["properties"]["schema"]["const"])
        )
    problem = _problem(facts, SCHEMA, "")
    if problem:
        raise FactsError("facts: %s" % problem)


def _resolve(rule: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in rule:
        rule = dict(SCHEMA["$defs"][rule["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in rule.items() if k != "$ref"})
    return rule


def _expected(rule: dict[str, Any]) -> str:
    if "const" in rule:
        return repr(rule["const"])
    if "enum" in rule:
        return "one of " + ", ".join("null" if v is None else repr(v) for v in rule["enum"])
    kinds = rule.get("type", "any")
    text = " or ".join(kinds) if isinstance(kinds, list) else kinds
    text = {"integer": "an integer", "array": "a list", "object": "an object", "string": "a string"}.get(text, text)
    if "minimum" in rule:
        text += " >= %s" % rule["minimum"]
    return text


def _problem(value: Any, rule: dict[str, Any], where: str) -> str | None:
    """The first way `value` breaks `rule`, as "field: must be X, not Y", or None."""
    rule = _resolve(rule)
    name = where or "the facts"

    def bad(expected: str) -> str:
        shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
        return "%s must be %s, not %s" % (name, expected, shown)

    if "oneOf" in rule:
        if not any(_problem(value, option, where) is None for option in rule["oneOf"]):
            return bad(" or ".join(_expected(_resolve(option)) for option in rule["oneOf"]))
        return None
    if "const" in rule and value != rule["const"]:
        return bad(_expected(rule))
    if "enum" in rule and value not in rule["enum"]:
        return bad(_expected(rule))
    kinds = rule.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_TYPES[kind](value) for kind in kinds):
            return bad(_expected(rule))
    if "minimum" in rule and _TYPES["number"](value) and value < rule["minimum"]:
        return bad(_expected(rule))
    if isinstance(value, dict):
        for key in rule.get("required", []):
            if key not in value:
                return "%s is missing" % (where + "." + key if where else key)
        for key, item in value.items():
            sub = rule.get("properties", {}).get(key, rule.get("additionalProperties"))
            if isinstance(sub, dict):
                problem = _problem(item, sub, where + "." + key if where else key)
                if problem:
                    return problem
    if isinstance(value, list):
        if len(value) < rule.get("minItems", 0):
            return "%s must hold at least %d item(s)" % (name, rule["minItems"])
        if "items" in rule:
            for index, item in enumerate(value):
                problem = _problem(item, rule["items"], "%s[%d]" % (name, index))
                if problem:
                    return problem
    return None
