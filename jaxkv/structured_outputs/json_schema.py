"""Rewrites of a request's JSON schema before llguidance compiles it. Each one only narrows what
the schema accepts, so whatever the grammar lets through still validates against the schema
the client sent.

- `close_objects`: objects that declare properties and say nothing of ``additionalProperties``
  get ``false`` (OpenAI's strict mode; vLLM's default backend, xgrammar, reads them so).
- `bound_numbers`: every number has at most MAX_INTEGER_DIGITS digits before the point and
  MAX_FRACTION_DIGITS after it, and no exponent, so a model cannot write digits until
  ``max_tokens`` (``1.1111111111111111555333...``). Typed numbers get JSON Schema bounds
  (``exclusiveMinimum``/``exclusiveMaximum`` of 10**16, ``multipleOf`` 1e-10), which llguidance
  compiles into a finite number rule; values a schema leaves free (``json_object``, an open
  ``additionalProperties``, arrays without ``items``) get a recursive any-JSON-value
  definition whose numbers carry the same bounds.
"""

from __future__ import annotations

MAX_INTEGER_DIGITS = 16  # as llama.cpp's JSON grammar bounds the integer part
MAX_FRACTION_DIGITS = 10  # the finest multipleOf llguidance takes exactly (1e-11 is refused)

ANY_VALUE = "jaxkv_any_value"  # the $defs entry free values point to
_ANY_REF = {"$ref": f"#/$defs/{ANY_VALUE}"}

_SUBSCHEMA = ("items", "additionalProperties", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# "not" and "if" are left alone: narrowing inside them would widen the schema.


def _map_subschemas(schema: dict, fn) -> dict:
    """A copy of `schema` with `fn` applied to each direct subschema."""
    out = dict(schema)
    for k in _SUBSCHEMA:
        if isinstance(out.get(k), dict):
            out[k] = fn(out[k])
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [fn(s) for s in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {n: fn(s) for n, s in out[k].items()}
    return out


def close_objects(schema):
    """A copy of `schema` where every object schema that declares properties and says nothing
    of additionalProperties gets false. An object without declared properties
    ({"type": "object"}, or one whose keys come from anyOf branches) is left open: false there
    would allow no key at all."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, close_objects)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _types(schema: dict) -> set:
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _bound_number(schema: dict) -> dict:
    """Numeric bounds added where the schema sets none of its own."""
    types = _types(schema)
    if not types & {"number", "integer"} or "const" in schema or "enum" in schema:
        return schema
    out = dict(schema)
    top = 10 ** MAX_INTEGER_DIGITS
    lo = _number(out.get("minimum", out.get("exclusiveMinimum")))
    hi = _number(out.get("maximum", out.get("exclusiveMaximum")))
    if "minimum" not in out and "exclusiveMinimum" not in out and (hi is None or hi > -top):
        out["exclusiveMinimum"] = -top
    if "maximum" not in out and "exclusiveMaximum" not in out and (lo is None or lo < top):
        out["exclusiveMaximum"] = top
    if "number" in types and "multipleOf" not in out:
        out["multipleOf"] = float(f"1e-{MAX_FRACTION_DIGITS}")
    return out


def _number(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _free(sub) -> bool:
    return sub is True or sub == {}


def _bound_free_values(schema: dict) -> dict:
    """Values the schema leaves free (an open object's other keys, an array's unset items)
    point to the bounded any-value definition."""
    out = dict(schema)
    types = _types(out)
    is_object = "object" in types or "properties" in out
    if is_object and _free(out.get("additionalProperties", True)):
        out["additionalProperties"] = _ANY_REF
    if "array" in types and _free(out.get("items", True)):
        out["items"] = _ANY_REF
    return out


def _bound(schema):
    if _free(schema):
        return dict(_ANY_REF)
    if not isinstance(schema, dict):
        return schema
    if "$id" in schema:  # a nested resource: "#/$defs/..." would resolve against its own root
        return schema
    return _bound_free_values(_bound_number(_map_subschemas(schema, _bound)))


def any_value_schema() -> dict:
    """Any JSON value, its numbers bounded (refers to itself through #/$defs/ANY_VALUE)."""
    leaves = [{"type": "string"}, {"type": "boolean"}, {"type": "null"},
              _bound_number({"type": "number"}), _bound_number({"type": "integer"})]
    return {"anyOf": leaves + [{"type": "array", "items": _ANY_REF},
                               {"type": "object", "additionalProperties": _ANY_REF}]}


def bound_numbers(schema):
    """A copy of `schema` (a dict or a boolean) whose numbers are bounded in length: typed ones
    by JSON Schema bounds, free values through a bounded any-value definition added to the
    root's $defs. A schema whose root is not an object schema (true) becomes the any-value
    schema itself."""
    if schema is True or schema == {}:
        schema = {"$ref": f"#/$defs/{ANY_VALUE}"}
    if not isinstance(schema, dict):
        return schema
    root_id = schema.get("$id")
    body = {k: v for k, v in schema.items() if k != "$id"}
    out = _bound(body)
    if root_id is not None:
        out["$id"] = root_id
    if _refers_to_any(out):
        out["$defs"] = {**out.get("$defs", {}), ANY_VALUE: any_value_schema()}
    return out


def _refers_to_any(schema) -> bool:
    if isinstance(schema, dict):
        return schema == _ANY_REF or any(_refers_to_any(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_refers_to_any(v) for v in schema)
    return False
